"""Reinforcement-learning shape: trainers improve a policy while rollout workers, which never
train, act with the newest weights they can read, and say which version they acted with.

    openssl rand -hex 16 > read.token && chmod 600 read.token
    psserver serve --port 29500 --control-port 50051 --read-token-file read.token
    python examples/rl_rollouts.py trainer --rank 0 --num-trainers 2 &
    python examples/rl_rollouts.py trainer --rank 1 --num-trainers 2 &
    for w in 0 1 2 3; do python examples/rl_rollouts.py rollout --worker $w --read-token-file read.token & done

The environment is a contextual bandit: a context of 8 numbers, 4 actions, reward 1 for the
action a hidden linear rule picks (0.25 by chance). Trainers run REINFORCE on rollouts of their
own replica and hand their gradients to the server (the first one brings the policy). Each
rollout worker reads a version every ``--every`` global steps (the readers of the host share one
copy: ``share=True``), acts greedily with it on fresh contexts and prints
``worker W acted with version STEP: reward R``; once training stops it prints
``worker W: N versions, reward A -> B``. Rewards rise from about 0.25 to above 0.8.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import psserver

ACTIONS, FEATURES = 4, 8


def policy() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, ACTIONS))


def contexts(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` contexts and the action the hidden rule rewards for each."""
    rule = torch.randn(ACTIONS, FEATURES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, FEATURES, generator=generator)
    return x, (x @ rule.T).argmax(dim=1)


def train(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(100 + (args.rank or 0))
    with psserver.connect(args.server, rank=args.rank, num_trainers=args.num_trainers) as ps:
        model = ps.replica(policy(), optimizer=torch.optim.Adam(policy().parameters(), lr=0.01))
        while ps.steps < args.steps:
            x, best = contexts(args.batch_size, gen)
            dist = torch.distributions.Categorical(logits=model(x))
            action = dist.sample()
            reward = (action == best).float()
            loss = -((reward - reward.mean()) * dist.log_prob(action)).mean()
            loss.backward()
            ps.step(loss=loss)
        print(f"trainer {ps.rank}: {ps.steps} steps, global step {ps.global_step}", flush=True)


def rollout(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(7 + args.worker)
    acting = policy()
    rewards = []
    with psserver.read(args.control, token_file=args.read_token_file, name=f"rollout-{args.worker}",
                       share=True) as reader:
        print(f"worker {args.worker} waiting for the first version", flush=True)
        version = reader.wait(-1, timeout=args.idle)  # the first version, once a trainer brought the policy
        while version is not None:
            reader.load_into(acting, version)
            with torch.no_grad():
                x, best = contexts(1024, gen)
                reward = float((acting(x).argmax(dim=1) == best).float().mean())
            rewards.append(reward)
            print(f"worker {args.worker} acted with version {version.step}: reward {reward:.3f}", flush=True)
            version = reader.wait(version.step + args.every - 1, timeout=args.idle)
    if not rewards:
        raise SystemExit(f"worker {args.worker}: no version within {args.idle:g}s")
    print(f"worker {args.worker}: {len(rewards)} versions, reward {rewards[0]:.3f} -> {rewards[-1]:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    roles = p.add_subparsers(dest="role", required=True)
    t = roles.add_parser("trainer", help="train the policy")
    t.add_argument("--server", default=None, help="HOST:PORT (default $PSSERVER_SERVER or 127.0.0.1:29500)")
    t.add_argument("--rank", type=int, default=None)
    t.add_argument("--num-trainers", type=int, default=None)
    t.add_argument("--steps", type=int, default=100, help="steps of this trainer")
    t.add_argument("--batch-size", type=int, default=256)
    r = roles.add_parser("rollout", help="act with the newest weights, never train")
    r.add_argument("--control", default=None, help="the server's control plane HOST:PORT (default 127.0.0.1:50051)")
    r.add_argument("--read-token-file", default=None)
    r.add_argument("--worker", type=int, default=0)
    r.add_argument("--every", type=int, default=20, help="read a version every this many global steps")
    r.add_argument("--idle", type=float, default=30.0, help="stop after this many seconds without a new version")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(args) if args.role == "trainer" else rollout(args)


if __name__ == "__main__":
    main()
