"""``StateDictReader`` (runtime/checkpoint/state_dict_reader.py) gives what ``get_state_dict`` gives, the short way only while
what it learnt still holds. Every case compares with torch's own ``get_state_dict`` called beside it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from trainwarden.runtime.checkpoint.state_dict_reader import StateDictReader, _difference

pytestmark = pytest.mark.timeout(120)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(3, 6)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _assert_as_torch_gives(reader: StateDictReader, options: StateDictOptions | None = None) -> None:
    got = reader.read()
    expected = get_state_dict(reader.model, reader.optimizers, options=options)
    assert _difference(expected, got) is None
    for want, have in zip(_tensors(expected), _tensors(got)):
        assert torch.equal(want, have)


def _tensors(value):
    if isinstance(value, dict):
        for entry in value.values():
            yield from _tensors(entry)
    elif isinstance(value, (list, tuple)):
        for entry in value:
            yield from _tensors(entry)
    elif isinstance(value, torch.Tensor):
        yield value


@pytest.mark.parametrize("options", [None, FLAT], ids=["nested", "flattened"])
def test_every_read_is_what_get_state_dict_gives_and_after_the_first_it_takes_the_short_way(options):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    reader = StateDictReader(model, optimizer, options=options)
    _assert_as_torch_gives(reader, options)
    assert reader.fast_reads == 0
    for _ in range(3):
        _train(model, optimizer)
        _assert_as_torch_gives(reader, options)
    assert reader.fast_reads == 3
    model_sd, optim_sd = reader.read()
    key = "state.0.weight.exp_avg" if options else "0.weight"
    held = optim_sd[key] if options else optim_sd["state"]["0.weight"]["exp_avg"]
    assert held is optimizer.state[model[0].weight]["exp_avg"]  # the optimizer's own tensor, not a copy
    assert model_sd["0.weight"].data_ptr() == model[0].weight.data_ptr()


def test_an_optimizer_with_no_state_gets_it_as_from_get_state_dict_then_the_short_way():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reader = StateDictReader(model, optimizer, options=FLAT)
    model_sd, optim_sd = reader.read()  # get_state_dict makes the state with a zero-lr step
    assert "state.0.weight.exp_avg" in optim_sd and reader.fast_reads == 0
    _assert_as_torch_gives(reader, FLAT)
    assert reader.fast_reads == 1


def test_an_optimizer_that_keeps_no_state_takes_the_short_way_too():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)  # no momentum: no state, ever
    reader = StateDictReader(model, optimizer, options=FLAT)
    for _ in range(3):
        _train(model, optimizer)  # gradients set to None after each step
        _assert_as_torch_gives(reader, FLAT)
    assert not optimizer.state and reader.fast_reads == 2


def test_gradients_before_the_first_step_are_read_as_torch_reads_them():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).pow(2).sum().backward()  # gradients, no state: get_state_dict makes none
    reader = StateDictReader(model, optimizer, options=FLAT)
    for _ in range(2):
        _assert_as_torch_gives(reader, FLAT)
    assert not optimizer.state and reader.fast_reads == 1
    optimizer.zero_grad(set_to_none=True)  # now get_state_dict makes the state: the reader lets it
    _assert_as_torch_gives(reader, FLAT)
    assert optimizer.state and reader.fast_reads == 1
    _assert_as_torch_gives(reader, FLAT)
    assert reader.fast_reads == 2


def test_a_new_parameter_or_a_replaced_one_goes_back_to_get_state_dict_and_learns_again():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    reader = StateDictReader(model, optimizer, options=FLAT)
    reader.read()
    model.add_module("head", torch.nn.Linear(2, 2))
    optimizer.add_param_group({"params": model.head.parameters(), "lr": 5e-3})
    _train(model, optimizer)
    _assert_as_torch_gives(reader, FLAT)
    assert reader.fast_reads == 0  # not the short way: the model changed
    _assert_as_torch_gives(reader, FLAT)
    assert reader.fast_reads == 1  # learnt again
    old = model[0].weight
    model[0].weight = new = torch.nn.Parameter(old.detach().clone())  # a parameter replaced in model and optimizer
    optimizer.param_groups[0]["params"][0] = new
    optimizer.state[new] = optimizer.state.pop(old)
    _assert_as_torch_gives(reader, FLAT)
    assert reader.fast_reads == 1
    _assert_as_torch_gives(reader, FLAT)
    assert reader.fast_reads == 2


def test_tied_weights_and_several_optimizers_read_as_torch_reads_them():
    model = torch.nn.Module()
    model.body = body = _model()
    model.tied = torch.nn.Linear(6, 5, bias=False)
    model.tied.weight = body[0].weight  # one parameter, two keys
    first = torch.optim.AdamW(list(body[0].parameters()) + list(body[1].parameters()), lr=1e-2)
    second = torch.optim.SGD(body[2].parameters(), lr=1e-2, momentum=0.9)
    for _ in range(2):
        body(torch.randn(3, 6)).pow(2).sum().backward()
        first.step(), second.step()
        first.zero_grad(), second.zero_grad()
    reader = StateDictReader(model, [first, second])
    for _ in range(2):
        _assert_as_torch_gives(reader)
    assert reader.fast_reads == 1
    assert "tied.weight" in reader.read()[0]


@pytest.mark.parametrize("options", [None, FLAT], ids=["nested", "flattened"])
def test_a_model_without_optimizers_reads_as_torch_reads_it(options):
    reader = StateDictReader(_model(), [], options=options)
    for _ in range(2):
        _assert_as_torch_gives(reader, options)
    assert reader.fast_reads == 1 and reader.read()[1] == {}


def test_options_it_does_not_serve_always_ask_get_state_dict():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    options = StateDictOptions(ignore_frozen_params=True)
    reader = StateDictReader(model, optimizer, options=options)
    for _ in range(2):
        _assert_as_torch_gives(reader, options)
    assert reader.fast_reads == 0


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_ddp_model_reads_as_torch_reads_it_without_the_wrappers_prefix(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    for options in (None, FLAT):
        reader = StateDictReader(model, optimizer, options=options)
        for _ in range(3):
            _assert_as_torch_gives(reader, options)
        assert reader.fast_reads == 2
    assert "module.0.weight" in model.state_dict() and "0.weight" in reader.read()[0]
    assert "state.0.weight.exp_avg" in reader.read()[1]


def test_a_compiled_model_reads_as_torch_reads_it_without_orig_mod():
    model = torch.compile(_model())  # never called: nothing is compiled, the wrapper is what matters here
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    reader = StateDictReader(model, optimizer, options=FLAT)
    for _ in range(2):
        _assert_as_torch_gives(reader, FLAT)
    assert reader.fast_reads == 1
    assert "_orig_mod.0.weight" in model.state_dict() and "0.weight" in reader.read()[0]


def test_a_child_module_called_module_keeps_its_name():
    model = torch.nn.Module()
    model.module = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.module(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    reader = StateDictReader(model, optimizer)
    for _ in range(2):
        _assert_as_torch_gives(reader)
    assert reader.fast_reads == 1 and "module.0.weight" in reader.read()[0]


def test_a_model_whose_keys_are_not_its_names_asks_get_state_dict_every_time(caplog):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model()
    model[0] = checkpoint_wrapper(model[0])  # parameters named ..._checkpoint_wrapped_module..., keys without it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    reader = StateDictReader(model, optimizer)
    with caplog.at_level("INFO", logger="trainwarden.runtime.checkpoint.state_dict_reader"):
        for _ in range(3):
            _assert_as_torch_gives(reader)
    assert reader.fast_reads == 0
    assert sum("from get_state_dict on every call" in r.getMessage() for r in caplog.records) == 1


def test_fsdp2_dtensor_shards_read_as_torch_reads_them(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (1,))
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, steps=2)
    reader = StateDictReader(model, optimizer, options=FLAT)
    _assert_as_torch_gives(reader, FLAT)
    _train(model, optimizer)
    _assert_as_torch_gives(reader, FLAT)
    assert reader.fast_reads == 1
    assert isinstance(reader.read()[0]["0.weight"], DTensor)
