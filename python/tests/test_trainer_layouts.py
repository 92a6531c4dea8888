"""DeepSpeed and Megatron-LM checkpoints through the command line (issue 19).

Neither trainer is installed here, so each test writes its trainer's files
the way that trainer does: ``torch.save`` of the very dictionaries it saves
(key for key, with the same kinds of values: flat fp32 ZeRO partitions,
``argparse.Namespace`` args, Python and NumPy RNG states, a loss-scaler
object), in the directory layout it uses, after real training steps of a
small transformer-shaped model in mixed precision. Then: commit each step,
check that ckvc reads the files as tensors (``show --json``), that a later
step's large tensors are stored as deltas, that every checkout is byte for
byte the saved directory, and that ``torch.load`` of a checkout gives back
the saved dictionaries.
"""

import argparse
import filecmp
import json
import os
import random
from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from same import assert_same  # noqa: E402

VOCAB, DIM, LAYERS = 512, 64, 2


class LossScaler:
    """Stands in for deepspeed.runtime.fp16.loss_scaler.LossScaler: a plain
    object pickled by class reference (ckvc never executes the pickle)."""

    def __init__(self, scale):
        self.cur_scale = scale
        self.cur_iter = 0

    def __eq__(self, other):
        return type(other) is LossScaler and vars(self) == vars(other)


def _model():
    torch.manual_seed(0)
    layers = [torch.nn.Embedding(VOCAB, DIM)]
    for _ in range(LAYERS):
        layers += [torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM)]
    layers.append(torch.nn.Linear(DIM, VOCAB))
    return torch.nn.Sequential(*layers)


def _train(model, opt, steps):
    for _ in range(steps):
        x = torch.randint(0, VOCAB // 4, (8, 16))  # narrow data: most rows never move
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _deepspeed(model, opt, run, step):
    """``global_stepN/`` as DeepSpeed's engine writes it with ZeRO stage 2 on
    one rank: bf16 module weights in ``mp_rank_00_model_states.pt``, the fp32
    master partition and Adam's state (flat) in the ZeRO optimizer file, and
    the run's ``latest`` file naming the step's tag."""
    d = run / f"global_step{step}"
    d.mkdir(parents=True)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    ds_config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    module = OrderedDict((k, v.detach().to(torch.bfloat16).clone()) for k, v in model.state_dict().items())
    torch.save(
        {
            "module": module,
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": [OrderedDict((n, p.shape) for n, p in zip(names, params))],
            "frozen_param_shapes": None,
            "shared_params": {},
            "frozen_param_fragments": None,
            "lr_scheduler": {"last_epoch": step, "_step_count": step + 1, "base_lrs": [1e-3]},
            "data_sampler": None,
            "random_ltd": None,
            "sparse_tensor_module_names": set(),
            "skipped_steps": 0,
            "global_steps": step,
            "global_samples": step * 8,
            "dp_world_size": 1,
            "mp_world_size": 1,
            "ds_config": ds_config,
            "ds_version": "0.16.0",
        },
        d / "mp_rank_00_model_states.pt",
    )
    st = opt.state_dict()
    state = [st["state"][i] for i in range(len(params))]
    fp32 = _flat(params)
    offsets, at = OrderedDict(), 0
    for n, p in zip(names, params):
        offsets[n] = (at, p.numel())
        at += p.numel()
    torch.save(
        {
            "optimizer_state_dict": {
                "loss_scaler": LossScaler(1.0),
                "dynamic_loss_scale": False,
                "overflow": False,
                "clip_grad": 1.0,
                "base_optimizer_state": [
                    {
                        "step": state[0]["step"].clone(),
                        "exp_avg": _flat(s["exp_avg"] for s in state),
                        "exp_avg_sq": _flat(s["exp_avg_sq"] for s in state),
                    }
                ],
                "single_partition_of_fp32_groups": [fp32],
                "zero_stage": 2,
                "group_paddings": [0],
                "partition_count": [1],
                "ds_version": "0.16.0",
                "param_slice_mappings": [offsets],
            },
            "ds_config": ds_config,
            "ds_version": "0.16.0",
        },
        d / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    (run / "latest").write_text(f"global_step{step}")
    return d


def _megatron(model, opt, run, step):
    """``iter_NNNNNNN/mp_rank_00/model_optim_rng.pt`` as Megatron-LM's legacy
    checkpointing writes it (one tensor-parallel rank), with the run's
    ``latest_checkpointed_iteration.txt``."""
    d = run / f"iter_{step:07d}"
    (d / "mp_rank_00").mkdir(parents=True)
    sd = model.state_dict()
    language_model = OrderedDict(
        embedding=OrderedDict(word_embeddings=OrderedDict(weight=sd["0.weight"].to(torch.bfloat16))),
        encoder=OrderedDict((f"layers.{k}", v.to(torch.bfloat16)) for k, v in sd.items() if k != "0.weight"),
    )
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=DIM, bf16=True, seq_length=16, iteration=step, save="/ckpt")
    random.seed(step)
    np.random.seed(step)
    torch.save(
        {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": step,
            "model": OrderedDict(language_model=language_model),
            "optimizer": {
                "optimizer": opt.state_dict(),
                "fp32_from_fp16_params": [[p.detach().clone() for p in model.parameters()]],
            },
            "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": step * 8, "warmup_steps": 0, "decay_style": "cosine"},
            "rng_state": [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "cuda_rng_state": None,
                    "rng_tracker_states": {},
                }
            ],
            "num_floating_point_operations_so_far": 0,
        },
        d / "mp_rank_00" / "model_optim_rng.pt",
    )
    (run / "latest_checkpointed_iteration.txt").write_text(str(step))
    return d


def _files(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


def _run(cli, tmp_path, write, steps):
    """Train, write each step with `write`, commit it; returns the repo,
    the checkpoint directories and the `show --json` of the last step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run, dirs = tmp_path / "run", {}
    for step in steps:
        _train(model, opt, 3)
        dirs[step] = write(model, opt, run, step)
    repo = tmp_path / "repo"
    cli("init", repo)
    for step in steps:
        line = cli("-C", repo, "commit", dirs[step]).stdout
        assert f"step {step}" in line, line  # the step comes from the directory name
    shown = json.loads(cli("-C", repo, "show", steps[-1], "--json").stdout)
    return repo, dirs, shown


def _check_out(cli, repo, dirs, tmp_path):
    for step, d in dirs.items():
        out = tmp_path / f"co-{step}"
        cli("-C", repo, "checkout", step, "-o", out)
        assert _files(out) == _files(d)
        for rel in _files(d):
            assert filecmp.cmp(d / rel, out / rel, shallow=False), rel
            assert_same(torch.load(d / rel, weights_only=False), torch.load(out / rel, weights_only=False), rel)


def _tensors(shown, path):
    f = next(f for f in shown["files"] if f["path"] == path)
    assert f["warning"] is None, f["warning"]
    return f, {t["name"]: t for t in f["tensors"]}


def test_deepspeed_zero_checkpoints_commit_as_tensors_with_deltas_and_check_out_exactly(cli, tmp_path):
    repo, dirs, shown = _run(cli, tmp_path, _deepspeed, (10, 20, 30))
    f, model = _tensors(shown, "mp_rank_00_model_states.pt")
    assert "module.0.weight" in model and model["module.0.weight"]["dtype"] in ("bf16", "BF16"), list(model)
    f, optim = _tensors(shown, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    flat = "optimizer_state_dict.single_partition_of_fp32_groups.0"
    assert flat in optim, list(optim)
    for name in (flat, "optimizer_state_dict.base_optimizer_state.0.exp_avg"):
        assert optim[name]["storage"]["stored_as"] == "delta", (name, optim[name]["storage"])
    tensor_bytes = sum(t["bytes"] for t in optim.values())
    assert tensor_bytes >= 0.9 * f["bytes"], (tensor_bytes, f["bytes"])
    _check_out(cli, repo, dirs, tmp_path)


def test_megatron_legacy_checkpoints_commit_as_tensors_with_deltas_and_check_out_exactly(cli, tmp_path):
    repo, dirs, shown = _run(cli, tmp_path, _megatron, (100, 200))
    f, ts = _tensors(shown, "mp_rank_00/model_optim_rng.pt")
    word = "model.language_model.embedding.word_embeddings.weight"
    assert word in ts, list(ts)
    assert "optimizer.optimizer.state.0.exp_avg" in ts, list(ts)
    assert "optimizer.fp32_from_fp16_params.0.0" in ts, list(ts)
    for name in (word, "optimizer.fp32_from_fp16_params.0.0", "optimizer.optimizer.state.0.exp_avg_sq"):
        assert ts[name]["storage"]["stored_as"] == "delta", (name, ts[name]["storage"])
    tensor_bytes = sum(t["bytes"] for t in ts.values())
    assert tensor_bytes >= 0.9 * f["bytes"], (tensor_bytes, f["bytes"])
    _check_out(cli, repo, dirs, tmp_path)
