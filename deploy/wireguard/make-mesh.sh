#!/bin/bash
# One WireGuard mesh for a psserver job: keys and one wg0.conf per host, so that the RPC
# store and TensorPipe (plaintext) travel encrypted, on addresses only the mesh reaches.
#
#   deploy/wireguard/make-mesh.sh [-o DIR] [-p PORT] [-s PREFIX] [-F] SERVER_HOST TRAINER_HOST...
#
#   SERVER_HOST, TRAINER_HOST  the address (or name) each host is reached at today; the first
#                              is the server (PREFIX.1), the others trainers (PREFIX.2, ...)
#   -o DIR     where to write (default ./wg-mesh); refuses to overwrite an existing host's files
#   -p PORT    WireGuard's UDP port on every host (default 51820)
#   -s PREFIX  the mesh's /24, three octets (default 10.77.0)
#   -F         leave out the PostUp/PreDown firewall rules (iptables), which drop packets for
#              the host's mesh address that arrive on any interface but wg0 and lo
#
# Every host is a peer of every other one: trainers talk to the server, the server calls
# back, and a joining trainer calls every member of the RPC group. Writes DIR/HOST/wg0.conf
# (private key inside, mode 600) and DIR/hosts (mesh address, role, host). Needs `wg`
# (wireguard-tools; $WG names another binary) to make keys; no network access.
# Then, on each host (see deploy/wireguard/README.md):
#   sudo install -m 600 wg0.conf /etc/wireguard/wg0.conf && sudo wg-quick up wg0
#   server:   psserver serve --host 10.77.0.1 --port 29500 --join-token-file token --supervise ...
#   trainers: psserver train --server 10.77.0.1:29500 --join-token-file token --reconnect ...
set -euo pipefail

usage() {
    sed -n '5,13p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

OUT=./wg-mesh
PORT=51820
PREFIX=10.77.0
FIREWALL=1
while getopts ':o:p:s:Fh' opt; do
    case $opt in
        o) OUT=$OPTARG ;;
        p) PORT=$OPTARG ;;
        s) PREFIX=$OPTARG ;;
        F) FIREWALL= ;;
        h) usage ;;
        :) echo "make-mesh.sh: -$OPTARG needs a value" >&2; usage ;;
        *) echo "make-mesh.sh: unknown option -$OPTARG" >&2; usage ;;
    esac
done
shift $((OPTIND - 1))
HOSTS=("$@")

fail() {
    echo "make-mesh.sh: $*" >&2
    exit 2
}

(( ${#HOSTS[@]} >= 2 )) || fail "give the server's host and at least one trainer's host"
(( ${#HOSTS[@]} <= 253 )) || fail "at most 253 hosts fit in one /24, got ${#HOSTS[@]}"
[[ $PORT =~ ^[0-9]+$ ]] && (( PORT >= 1 && PORT <= 65535 )) || fail "-p $PORT: not a UDP port"
octet='(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])'
[[ $PREFIX =~ ^$octet\.$octet\.$octet$ ]] || fail "-s $PREFIX: want three octets, e.g. 10.77.0"
declare -A SEEN=()
for host in "${HOSTS[@]}"; do
    [[ $host =~ ^[A-Za-z0-9._:-]+$ ]] || fail "not a host name or address: '$host'"
    [[ -z ${SEEN[$host]:-} ]] || fail "host given twice: $host"
    SEEN[$host]=1
done

WG=${WG:-wg}
command -v "$WG" >/dev/null 2>&1 || fail "'$WG' not found: install wireguard-tools (it makes the keys)"

umask 077
mkdir -p -- "$OUT"
for host in "${HOSTS[@]}"; do
    [[ ! -e "$OUT/$host/wg0.conf" ]] || fail "$OUT/$host/wg0.conf exists: keep the mesh you have, or remove $OUT"
done

# Keys, one pair per host; the private key never leaves its host's directory.
declare -a PRIVATE=() PUBLIC=() ADDRESS=()
for i in "${!HOSTS[@]}"; do
    PRIVATE[i]=$("$WG" genkey)
    PUBLIC[i]=$(printf '%s\n' "${PRIVATE[i]}" | "$WG" pubkey)
    ADDRESS[i]=$PREFIX.$((i + 1))
done

endpoint() {  # host:port, with an IPv6 address in brackets
    if [[ $1 == *:* ]]; then printf '[%s]:%s' "$1" "$PORT"; else printf '%s:%s' "$1" "$PORT"; fi
}

: > "$OUT/hosts"
for i in "${!HOSTS[@]}"; do
    host=${HOSTS[i]}
    role=trainer
    (( i == 0 )) && role=server
    printf '%s %s %s\n' "${ADDRESS[i]}" "$role" "$host" >> "$OUT/hosts"
    mkdir -p -- "$OUT/$host"
    conf=$OUT/$host/wg0.conf
    {
        echo "# psserver mesh: $host, the $role, at ${ADDRESS[i]} (made by deploy/wireguard/make-mesh.sh)"
        echo "[Interface]"
        echo "Address = ${ADDRESS[i]}/24"
        echo "ListenPort = $PORT"
        echo "PrivateKey = ${PRIVATE[i]}"
        if [[ -n $FIREWALL ]]; then
            # Linux accepts a packet for any local address on any interface: without these,
            # a neighbour on the LAN could route packets for the mesh address to this host.
            echo "# Packets for the mesh address are taken from wg0 and lo only."
            echo "PostUp = iptables -I INPUT -d ${ADDRESS[i]}/32 ! -i %i -j DROP; iptables -I INPUT -d ${ADDRESS[i]}/32 -i lo -j ACCEPT"
            echo "PreDown = iptables -D INPUT -d ${ADDRESS[i]}/32 -i lo -j ACCEPT; iptables -D INPUT -d ${ADDRESS[i]}/32 ! -i %i -j DROP"
        fi
        for j in "${!HOSTS[@]}"; do
            (( j == i )) && continue
            peer_role=trainer
            (( j == 0 )) && peer_role=server
            echo
            echo "[Peer]"
            echo "# ${HOSTS[j]} ($peer_role)"
            echo "PublicKey = ${PUBLIC[j]}"
            echo "AllowedIPs = ${ADDRESS[j]}/32"
            echo "Endpoint = $(endpoint "${HOSTS[j]}")"
            echo "PersistentKeepalive = 25"
        done
    } > "$conf"
    chmod 600 -- "$conf"
done

cat <<DONE
make-mesh.sh: ${#HOSTS[@]} hosts in $OUT (server ${ADDRESS[0]}, trainers ${ADDRESS[1]}..${ADDRESS[${#HOSTS[@]}-1]}); on each HOST:
  sudo install -m 600 $OUT/HOST/wg0.conf /etc/wireguard/wg0.conf && sudo wg-quick up wg0
then (UDP $PORT open between the hosts):
  psserver serve --host ${ADDRESS[0]} --port 29500 --join-token-file TOKEN_FILE --supervise --checkpoint-dir DIR   # on ${HOSTS[0]}
  psserver train --server ${ADDRESS[0]}:29500 --join-token-file TOKEN_FILE --reconnect   # on each trainer
DONE
