"""The HF Trainer callback: commits in the background, prunes only what is
committed and verified, and a resume from a checked-out step equals a
resume from the original directory."""

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ckvc  # noqa: E402
from ckvc.integrations.transformers import CkvcCallback  # noqa: E402


class Data(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=97):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def make_trainer(out_dir, callbacks=()):
    transformers.set_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(out_dir),
        max_steps=6,
        save_steps=2,
        save_strategy="steps",
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=list(callbacks))


def final_weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_callback_commits_prunes_and_resume_matches(tmp_path):
    repo_path = tmp_path / "repo"
    run = tmp_path / "run"
    cb = CkvcCallback(str(repo_path), keep_local=2)
    make_trainer(run, [cb]).train()
    repo = ckvc.Repository(repo_path)
    assert repo.steps() == [2, 4, 6]
    log = repo.log()
    assert "loss" in log[0].metrics
    # checkpoint-2 was committed, verified and deleted; the newest 2 stay
    assert not (run / "checkpoint-2").exists()
    assert (run / "checkpoint-4").is_dir() and (run / "checkpoint-6").is_dir()

    co = tmp_path / "from-ckvc"
    repo.checkout(4, co)
    for name in os.listdir(run / "checkpoint-4"):
        assert (co / name).read_bytes() == (run / "checkpoint-4" / name).read_bytes(), name

    a = make_trainer(tmp_path / "resume-a")
    a.train(resume_from_checkpoint=str(co))
    b = make_trainer(tmp_path / "resume-b")
    b.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # the resumed run went on from step 4 (weights moved from the checkpoint)
    ck = repo.load(4)["model.safetensors"]
    assert not torch.equal(ck["transformer.h.0.attn.c_attn.weight"], wa["transformer.h.0.attn.c_attn.weight"])


def test_checkpoints_rotated_away_before_their_commit_are_still_committed(tmp_path, monkeypatch):
    # Review finding: on_save only queued the path; with save_total_limit=1
    # the Trainer deleted checkpoint-N before the (slow) commit ran.
    import time

    import ckvc.integrations.transformers as integ

    real = integ._ckvc.commit_dir

    class Slow:
        Reader = integ._ckvc.Reader

        @staticmethod
        def commit_dir(*a, **k):
            time.sleep(0.5)  # a large model's commit outlasts a few steps
            return real(*a, **k)

    monkeypatch.setattr(integ, "_ckvc", Slow)
    trainer = make_trainer(tmp_path / "run", [CkvcCallback(str(tmp_path / "repo"))])
    trainer.args.save_steps = 1
    trainer.args.save_total_limit = 1
    trainer.train()
    assert ckvc.Repository(tmp_path / "repo").steps() == [1, 2, 3, 4, 5, 6]
    assert not (tmp_path / "run" / ".ckvc-snapshots").exists(), "snapshots are removed at the end"
