"""The data flags: ``--id-space`` in the forms people type, and flags a dataset does not use."""

from __future__ import annotations

import argparse

import pytest

from psserver.cli import main
from psserver.cli.args import add_data_arguments, data_from_args
from psserver.config.options import id_count


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_data_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("text", "value"), [("1099511627776", 1 << 40), ("2^40", 1 << 40), ("2**40", 1 << 40),
                                             (" 2 ^ 62 ", 1 << 62), ("20_000", 20_000), ("10**3", 1000)])
def test_id_counts(text, value):
    assert id_count(text) == value


@pytest.mark.parametrize("text", ["2^x", "two", "2^-1", "2^65", "1e12", ""])
def test_bad_id_counts_are_one_line_usage_errors(text, capsys):
    with pytest.raises(ValueError, match="2\\^"):
        id_count(text)
    with pytest.raises(SystemExit) as e:
        main(["train", "--dataset", "synthetic_clicks", "--id-space", text])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --id-space: " in err[0] and "2^" in err[0], err


def test_the_flags_reach_the_config():
    config = data_from_args(parse("--dataset", "synthetic_clicks", "--id-space", "2^30", "--click-vocab", "500",
                                  "--train-samples", "1000", "--eval-samples", "100", "--data-seed", "5"))
    assert (config.id_space, config.click_vocab, config.synthetic_train, config.synthetic_eval, config.seed) == \
        (1 << 30, 500, 1000, 100, 5)
    plain = data_from_args(parse())
    assert (plain.dataset, plain.synthetic_train, plain.synthetic_eval, plain.id_space) == ("synthetic", None, None,
                                                                                          1 << 40)


def test_flags_of_other_datasets_and_bad_values_are_value_errors():
    with pytest.raises(ValueError, match="--id-space applies to --dataset synthetic_clicks only, not synthetic"):
        data_from_args(parse("--id-space", "2^40"))
    with pytest.raises(ValueError, match="--train-samples applies to --dataset synthetic or synthetic_clicks or "
                                         "pysource only"):
        data_from_args(parse("--dataset", "movielens100k", "--train-samples", "10"))
    with pytest.raises(ValueError, match="--id-space must be between 2 and 2\\^62"):
        data_from_args(parse("--dataset", "synthetic_clicks", "--id-space", "2^63"))
    with pytest.raises(ValueError, match="unknown dataset 'cifar'"):
        data_from_args(parse("--dataset", "cifar", "--train-samples", "10"))


def test_dataset_args_workers_and_image_size_reach_the_config(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    config = data_from_args(parse("--dataset", "imagefolder", "--data-dir", str(tmp_path), "--data-workers", "3",
                                  "--image-size", "32"))
    assert (config.dataset, config.data_dir, config.workers, config.image_size) == ("imagefolder", tmp_path, 3, 32)
    config = data_from_args(parse("--dataset", "torch.utils.data:TensorDataset", "--dataset-args", "{}"))
    assert config.dataset_args == {} and config.workers is None


def test_bad_data_flags_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match=r"--dataset imagefolder needs --data-dir DIR"):
        data_from_args(parse("--dataset", "imagefolder"))
    with pytest.raises(ValueError, match=r"--dataset-args is not JSON"):
        data_from_args(parse("--dataset", "x:y", "--dataset-args", "{n: 1}"))
    with pytest.raises(ValueError, match=r"--dataset-args must be a JSON object"):
        data_from_args(parse("--dataset", "x:y", "--dataset-args", "[1]"))
    with pytest.raises(ValueError, match=r"--data-workers must be >= 0, got -1"):
        data_from_args(parse("--data-workers", "-1"))
    with pytest.raises(ValueError, match=r"--image-size applies to --dataset imagefolder, not synthetic"):
        data_from_args(parse("--image-size", "32"))
    with pytest.raises(ValueError, match=r"--dataset-args applies to --dataset MODULE:ATTR, not to --dataset mnist"):
        data_from_args(parse("--dataset", "mnist", "--data-dir", str(tmp_path), "--dataset-args", '{"n": 1}'))
