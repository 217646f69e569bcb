"""Benchmark: what the allow-list unpickler of checkpoint metadata costs against plain ``pickle.load`` (issue 44).

    python tests/bench/bench_metadata_unpickler.py --repeats 300
    python tests/bench/bench_metadata_unpickler.py --metadata /path/to/step-00000010/.metadata

Without ``--metadata`` it saves the reference GPT's state (model and AdamW state after one step, ``--layers``
blocks) with ``dcp.save`` in one process and uses that checkpoint's ``.metadata``. In the same process it loads the
file's bytes ``--repeats`` times with ``pickle.loads`` and with ``metadata_unpickler.load_metadata``, alternating
in rounds so both see the same machine, and prints the median time per load of each and their ratio; then the
median of a whole ``classify`` (open without following links, bounded read, allow-list load, stat of the data
files) for scale.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from trainwarden.agent.shared import checkpoint_layout as store
from trainwarden.agent.shared.metadata_unpickler import load_metadata
from trainwarden.runtime.examples.model import ModelConfig, build_model


def reference_checkpoint(directory: Path, layers: int) -> Path:
    model = build_model(ModelConfig(layers=layers), seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    optim.step()
    path = store.step_dir(directory, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 1}, checkpoint_id=str(path),
                 no_dist=True)
    return path / store.METADATA_NAME


def _per_load(load, data: bytes, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        load(data)
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metadata", type=Path, help="a checkpoint's .metadata (default: save the reference GPT's)")
    ap.add_argument("--layers", type=int, default=4, help="reference GPT blocks when saving one")
    ap.add_argument("--repeats", type=int, default=300, help="loads per loader")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds the repeats are split into")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        meta = args.metadata or reference_checkpoint(Path(tmp), args.layers)
        data = meta.read_bytes()
        ours, plain = load_metadata(data), pickle.loads(data)
        assert ours.storage_data.keys() == plain.storage_data.keys(), "the two loaders disagree"
        per_round = max(1, args.repeats // args.rounds)
        plain_s, ours_s = [], []
        for _ in range(args.rounds):
            plain_s.append(_per_load(pickle.loads, data, per_round))
            ours_s.append(_per_load(load_metadata, data, per_round))
        classify_s = []
        for _ in range(min(args.rounds, 20)):
            start = time.perf_counter()
            store.classify(meta.parent)
            classify_s.append(time.perf_counter() - start)
        p, o = statistics.median(plain_s), statistics.median(ours_s)
        print(f"metadata: {meta if args.metadata else f'reference GPT, {args.layers} layers'}: {len(data)} bytes, "
              f"{len(plain.storage_data)} storage items")
        print(f"pickle.loads         {p * 1e3:8.3f} ms per load (median of {args.rounds} rounds of {per_round})")
        print(f"allow-list unpickler {o * 1e3:8.3f} ms per load")
        print(f"ratio allow-list / pickle: {o / p:.2f}")
        print(f"classify (whole step directory): {statistics.median(classify_s) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
