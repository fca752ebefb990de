"""``--dataset MODULE:ATTR``: what a reference may name and return, and every bad input in one line."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from psserver.config import DataConfig
from psserver.data import load_dataset
from psserver.data.reference import load_user_dataset
from psserver.errors import UsageError
from tests.userproject import write_package

SOURCE = '''
    import torch
    from torch.utils.data import Dataset, IterableDataset, TensorDataset


    class Squares(Dataset):
        def __init__(self, n=10, width=3):
            self.n, self.width = n, width

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return torch.full((self.width,), float(i)), i % 2


    def pair(n=10):
        return Squares(n), Squares(4)


    def train_only():
        return Squares(6)


    def with_none():
        return Squares(6), None


    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(3), 0


    INSTANCE = Squares(5)
    NOT_CALLABLE = 42


    def returns_list():
        return [1, 2, 3]


    def returns_three():
        return Squares(), Squares(), Squares()


    def unpaired():
        return TensorDataset(torch.zeros(4, 3), torch.zeros(4), torch.zeros(4)), None


    class Singles(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.zeros(3)


    class Empty(Squares):
        def __len__(self):
            return 0


    class Negative(Squares):
        def __len__(self):
            return -5


    class Fractional(Squares):
        def __len__(self):
            return 2.5


    def raises(path="x"):
        raise FileNotFoundError(f"no such file: {path}")
'''


@pytest.fixture
def userdata(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_package(tmp_path, "userdata", {"sets": SOURCE})))
    return "userdata.sets"


@pytest.mark.parametrize(("attr", "args", "n_train", "n_held_out"), [
    ("pair", {"n": 7}, 7, 4),
    ("Squares", {"n": 8, "width": 2}, 8, None),
    ("train_only", {}, 6, None),
    ("with_none", {}, 6, None),
    ("INSTANCE", {}, 5, None),
])
def test_what_a_reference_may_give(userdata, attr, args, n_train, n_held_out):
    config = DataConfig(dataset=f"{userdata}:{attr}", dataset_args=args)
    train, held_out = load_dataset(config, None, None)
    assert len(train) == n_train
    assert (None if held_out is None else len(held_out)) == n_held_out


def test_an_iterable_dataset_is_taken_as_it_is(userdata):
    train, held_out = load_user_dataset(f"{userdata}:Stream", {})
    assert isinstance(train, IterableDataset) and held_out is None


def test_psservers_own_models_check_the_first_sample(userdata):
    with pytest.raises(ValueError, match=r"dataset userdata.sets:Squares has samples of shape \(3,\), the model "
                                         r"expects \(1, 28, 28\)"):
        load_dataset(DataConfig(dataset=f"{userdata}:Squares"), (1, 28, 28), 10)


@pytest.mark.parametrize(("dataset", "args", "match"), [
    # When the configuration is made: the import, the kind of object, the arguments.
    ("nowhere.sets:pair", None, r"--dataset nowhere.sets:pair: module 'nowhere.sets' is not importable"),
    ("userdata.sets:missing", None, r"'userdata.sets' has no attribute 'missing'"),
    ("userdata.sets:NOT_CALLABLE", None, r"is a int, not a Dataset, a Dataset class or a function returning one"),
    ("userdata.sets:pair", {"size": 3}, r"--dataset userdata.sets:pair does not accept these arguments: .*size"),
    ("userdata.sets:INSTANCE", {"n": 3}, r"is a Dataset object: it takes no --dataset-args"),
    ("userdata.sets:", None, r"is not MODULE:ATTR"),
    ("cifar", None, r"unknown dataset 'cifar'; known: imagefolder, mnist, movielens100k, pysource, synthetic, "
                    r"synthetic_clicks"),
    ("synthetic", {"n": 1}, r"--dataset-args applies to --dataset MODULE:ATTR, not to --dataset synthetic"),
])
def test_bad_references_are_one_line_at_configuration(userdata, dataset, args, match):
    with pytest.raises(UsageError, match=match) as e:
        DataConfig(dataset=dataset, dataset_args=args or {})
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


@pytest.mark.parametrize(("attr", "match"), [
    ("returns_list", r"returned a list of 3 \(int, int, int\), not a Dataset or a \(train, held_out\) pair of them"),
    ("returns_three", r"returned a tuple of 3"),
    ("unpaired", None),
    ("Singles", r"dataset userdata.sets:Singles: sample 0 is a Tensor, not an \(input, target\) pair"),
    ("Empty", r"dataset userdata.sets:Empty is empty"),
    ("Negative", r"dataset userdata.sets:Negative: its __len__ gives no number of samples \(ValueError: "
                 r"__len__\(\) should return >= 0\)"),
    ("Fractional", r"dataset userdata.sets:Fractional: its __len__ gives no number of samples \(TypeError: 'float'"),
    ("raises", r"--dataset userdata.sets:raises raised FileNotFoundError: no such file: x \(at .*sets.py:\d+\)"),
])
def test_what_the_user_code_gives_is_checked_when_called(userdata, attr, match):
    config = DataConfig(dataset=f"{userdata}:{attr}")  # resolves: the call is the trainer's
    if match is None:  # a TensorDataset of three tensors: its input is the first two (ids, dense)
        train, _ = load_dataset(config, None, None)
        assert isinstance(train, TensorDataset)
        return
    with pytest.raises(UsageError, match=match) as e:
        load_dataset(config, None, None)
    assert "\n" not in str(e.value)


def test_the_samples_are_read_as_given(userdata):
    train, _ = load_user_dataset(f"{userdata}:pair", {"n": 3})
    x, y = train[2]
    assert torch.equal(x, torch.full((3,), 2.0)) and y == 0
