"""Single-process checks of the reference model, its pipeline split and the synthetic data."""

import logging

import pytest
import torch

from trainwarden.runtime.examples import gpt
from trainwarden.runtime.examples.data import DataConfig, DataConfigError, SyntheticData
from trainwarden.runtime.examples.gpt import parse_args
from trainwarden.runtime.examples.model import (ModelConfig, ModelConfigError, build_model, split_for_stage,
                                       stage_layer_ids)
from trainwarden.runtime.examples.parallel import MeshConfig, MeshError, ParallelModel, lm_loss, stage_shapes

CFG = ModelConfig(vocab=32, dim=16, heads=4, layers=4, seq=12)


@pytest.mark.timeout(60)
def test_forward_backward_shapes_and_grads():
    model = build_model(CFG, seed=0)
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq))
    logits = model(tokens)
    assert logits.shape == (2, CFG.seq, CFG.vocab)
    loss = lm_loss(logits, torch.randint(0, CFG.vocab, (2, CFG.seq)))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.timeout(60)
def test_attention_is_causal():
    model = build_model(CFG, seed=0)
    a = torch.randint(0, CFG.vocab, (1, CFG.seq))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % CFG.vocab
    with torch.no_grad():
        assert torch.equal(model(a)[:, :-1], model(b)[:, :-1])


@pytest.mark.timeout(60)
def test_init_is_deterministic_per_seed():
    one, two, other = build_model(CFG, seed=3), build_model(CFG, seed=3), build_model(CFG, seed=4)
    for (name, p), (_, q), (_, r) in zip(one.named_parameters(), two.named_parameters(),
                                         other.named_parameters()):
        assert torch.equal(p, q), name
        if "norm" not in name:
            assert not torch.equal(p, r), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_split_keeps_fully_qualified_names(stages):
    full = dict(build_model(CFG, seed=0).named_parameters())
    seen: dict[str, int] = {}
    for stage in range(stages):
        part = split_for_stage(build_model(CFG, seed=0), stage, stages)
        for name, param in part.named_parameters():
            assert name in full and torch.equal(param, full[name]), name
            seen[name] = seen.get(name, 0) + 1
        names = dict(part.named_parameters())
        assert ("tok_embeddings.weight" in names) == (stage == 0)
        assert ("output.weight" in names) == (stage == stages - 1)
    assert seen == {name: 1 for name in full}    # every parameter owned by exactly one stage


@pytest.mark.timeout(60)
def test_stages_chained_equal_full_model():
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq))
    with torch.no_grad():
        expected = build_model(CFG, seed=1)(tokens)
        x = tokens
        for stage in range(2):
            x = split_for_stage(build_model(CFG, seed=1), stage, 2)(x)
    assert torch.allclose(x, expected, atol=1e-6)


@pytest.mark.timeout(60)
def test_stage_shapes_are_what_each_stage_receives_and_sends():
    """What the pipeline stages are told they receive and send is what they do (first, middle, last of 3)."""
    tokens = torch.randint(0, CFG.vocab, (3, CFG.seq))
    x = tokens
    for index in range(3):
        stage = split_for_stage(build_model(CFG, seed=1), index, 3)
        shapes = stage_shapes(stage, micro_batch=3)
        y = stage(x)
        for meta, real in ((shapes["input_args"], x), (shapes["output_args"], y)):
            assert meta.device.type == "meta" and (meta.shape, meta.dtype) == (real.shape, real.dtype), index
        assert shapes["input_args"].requires_grad == (index > 0)  # a later stage sends its input's gradient back
        x = y


def test_a_batch_the_pipeline_was_not_built_for_is_refused_by_name():
    pm = ParallelModel.__new__(ParallelModel)  # the check comes before any communication
    pm.micro_batch, pm.cfg = 2, MeshConfig(pp=2, micro_batches=2)
    with pytest.raises(ValueError, match="has 6 sequences, but its pipeline stage was built for 2 micro-batches of 2"):
        pm.train_step(torch.zeros(6, CFG.seq, dtype=torch.long), torch.zeros(6, CFG.seq, dtype=torch.long))


def test_stage_layer_ids_balanced_and_validated():
    assert [stage_layer_ids(5, s, 2) for s in range(2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ModelConfigError, match="fewer than --pp"):
        stage_layer_ids(1, 0, 2)
    with pytest.raises(ModelConfigError, match="not divisible by --heads"):
        ModelConfig(dim=10, heads=4)


def test_data_is_a_function_of_seed_step_and_index():
    data = SyntheticData(DataConfig(vocab=50, seq=16, batch=4, seed=7))
    inputs, targets = data.batch(3)
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    again, _ = SyntheticData(DataConfig(vocab=50, seq=16, batch=4, seed=7)).batch(3)
    assert torch.equal(inputs, again)
    halves = [data.batch(3, dp_rank=r, dp_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), inputs)               # dp slices tile the global batch
    assert not torch.equal(data.batch(4)[0], inputs)
    with pytest.raises(DataConfigError, match="not divisible"):
        data.batch(3, dp_rank=0, dp_size=3)


def test_mesh_check_names_the_problem():
    model = ModelConfig()
    MeshConfig(dp=2, tp=2, pp=2).check(world_size=8, model=model, batch=8)
    with pytest.raises(MeshError, match=r"world size 4 != dp\*tp\*pp"):
        MeshConfig(dp=2, tp=2, pp=2).check(world_size=4, model=model, batch=8)
    with pytest.raises(MeshError, match="--heads 4 is not divisible by --tp 3"):
        MeshConfig(tp=3).check(world_size=3, model=model, batch=8)
    with pytest.raises(MeshError, match="--micro-batches 2 is fewer than --pp 4"):
        MeshConfig(pp=4, micro_batches=2).check(world_size=4, model=model, batch=8)
    with pytest.raises(MeshError, match="--batch 6"):
        MeshConfig(dp=2, micro_batches=2).check(world_size=2, model=model, batch=6)


def test_parse_args_defaults_build_a_tiny_model():
    cfg = parse_args(["--dp", "2", "--tp", "2", "--pp", "2"])
    assert cfg.mesh.world_size == 8
    cfg.mesh.check(world_size=8, model=cfg.model, batch=cfg.batch)
    assert cfg.lr_at(1) < cfg.lr_at(cfg.warmup) == cfg.lr_at(cfg.warmup + 10)


def test_a_micro_batch_size_that_does_not_divide_a_dp_ranks_share_is_refused():
    """--batch 8 on one dp rank: micro-batches of 2 give four to accumulate, of 3 do not divide the 8 sequences."""
    cfg = parse_args(["--tp", "1", "--pp", "1", "--batch", "8", "--micro-batch-size", "2", "--steps", "2"])
    assert (cfg.mesh.dp, cfg.mesh.micro_batches, cfg.micro_batch_size) == (1, 4, 2)
    with pytest.raises(ValueError, match="--micro-batch-size 3 must be positive and divide"):
        parse_args(["--tp", "1", "--pp", "1", "--batch", "8", "--micro-batch-size", "3", "--steps", "2"])


def test_a_step_pad_is_seconds_of_zero_or_more():
    """The soak's stand-in for accelerator compute (--step-pad-s): a negative pad is refused by name."""
    assert parse_args(["--tp", "1", "--pp", "1", "--step-pad-s", "1.0"]).step_pad_s == 1.0
    assert parse_args(["--tp", "1", "--pp", "1"]).step_pad_s == 0.0
    with pytest.raises(ValueError, match="--step-pad-s must be 0 or more"):
        parse_args(["--tp", "1", "--pp", "1", "--step-pad-s", "-1"])


@pytest.fixture
def root_logging():
    """gpt.main() points the root logger at stdout, as a torchrun worker's does: put it back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_mesh_that_does_not_match_the_world_stops_the_worker_before_its_process_group(root_logging, capsys,
                                                                                          monkeypatch):
    """A worker of a 4-rank torchrun told dp2 x tp2 x pp2 says why and exits EXIT_BAD_CONFIG before it joins a
    process group or trains a step (what torchrun then does with a failed worker is torchrun's)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    rc = gpt.main(["--dp", "2", "--tp", "2", "--pp", "2", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == gpt.EXIT_BAD_CONFIG, out
    assert "[rank 3]" in out and "bad configuration: world size 4 != dp*tp*pp = 2*2*2 = 8" in out, out
    assert not torch.distributed.is_initialized() and " loss " not in out
