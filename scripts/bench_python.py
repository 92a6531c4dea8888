#!/usr/bin/env python3
"""Training-loop stall of ckvc's background save, beside torch.save + fsync
and torch.distributed.checkpoint.async_save, on a state of >= 1 GiB.

The state: a GPT-2-small-sized model (transformers' GPT2Config defaults,
~124M parameters, built from the config, no download) + AdamW after one
optimizer step (fp32 weights + exp_avg + exp_avg_sq: ~1.4 GiB). Rounds
(--rounds, 4 by default): a first save, then a save after each further
optimizer step (ckvc codes each as a delta: against the save before
where it kept that save's tensors, as a blocking save does, else against
the first save, its chain's keyframe; a later round shows whether a
save's cost grows with the depth of its chain). Disk: about 4 GiB per round (torch.save's
file and DCP's directory are removed after their round; the three ckvc
repositories keep every save) and 3.5 GiB for the memory runs.

Per method and round: stall (the time the training loop loses: the call
until it returns, plus how much longer the training steps run after it,
until the save is durable, take than steps with no save running: waiting
in optimizer.step() for a background copy, and sharing the cores with the
background work; the loop trains on while a save is in flight, as a real
one does, so work left after the first step is charged too, and so are
the steps beside the fault-in of the staging buffer that a first
background save starts once it is durable), time until durable
(fsynced / committed; the steps run meanwhile), bytes stored (on disk
for the new save), peak extra RSS from the call until durable
and, after a first background save, until its staging buffer is faulted
in (over the RSS before it, sampled every 5 ms). The RSS is measured on a
second run of the same save with no training step beside it (a step's
activations and gradients would hide it), on repositories of their own
(so the first save there takes the first-save path too), in the first two
rounds (later ones are deltas as the second is; "-" in the table). And
the save's CPU time: the process's, from the call until durable, less
the training steps' run meanwhile (a plain step's each). Its CPU time
over the cores the training loop leaves free (all of them for a blocking
save, which holds the loop) is a floor under its time until durable,
printed beside the durable target.

ckvc runs three times, each on its own repository (so each first save
stages into fresh memory): a blocking save (the call returns when the
commit is durable; the tensors are read in place, no staging copy),
staging="sync" (every tensor copied in the call) and staging="background"
(the default of blocking=False: large tensors copied in a thread while the
next forward/backward runs; optimizer.step() waits for the copy).

With --compute idle, the forward/backward of each step is replaced by a
sleep as long as a real one (measured while warming up): what the host CPU
of an accelerator trainer sees, free while the GPU computes. The
optimizer step still runs on the CPU and changes the saved tensors in
place (on the gradients of the last real backward). With --compute cpu
(the default) training computes on the CPU, and a background save's work
competes with it for the same cores.

The page cache matters on these VMs: while the guest holds ~10 GiB of it,
memory it touches for the first time faults in slowly (the hypervisor
reclaims), and that slows every step of the loop after a save that
leaves 1.4 GiB more resident (AdamW's optimizer.step() maps and faults in
~290 MiB of temporaries each step: 0.3 s steps took 0.6-0.8 s, at random,
for 20 steps and more, with no save at all, after a 1.4 GiB buffer was
faulted in; with the cache dropped they stayed at 0.3 s). Each round
prints the cache's size; --drop-caches (root) drops it before each round,
so runs start from the same state. That also drops the repository's blob
files, which a writer keeps cached for the next save's delta bases: the
delta saves then read their bases from the disk, which a loop that saves
every few minutes rarely does (GPT-2 small + AdamW: 2-4 CPU-s more a
background delta save, 13.1-15.7 against 10.9-11.0).

With --keep-bases every repository keeps what a save stored as the next
save's delta bases (``Repository(keep_bases=True)``; by default only a
blocking save does): background saves then hold a second copy of the state
beside their staging buffer, and each delta is against the save before.

    python3 scripts/bench_python.py [--work DIR] [--json] [--compute cpu|idle] [--rounds N] [--keep-bases] [--drop-caches]

Needs torch, transformers and the ckvc package (pip install .).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

# Steps a loop runs beside one background save before it waits for it.
MAX_STEPS = 30


# The names ckvc gives its threads: a save's (and its commit's), and the
# one faulting a staging buffer in.
SAVE_THREAD_PREFIX = "ckvc-save-"
WARM_THREAD = "ckvc-staging-warm"


def join_staging_warm() -> None:
    """Wait for every thread faulting in a staging buffer."""
    for t in threading.enumerate():
        if t.name == WARM_THREAD:
            t.join()


def ckvc_busy() -> bool:
    """True while a save's thread (its commit included) or a staging
    buffer's fault-in, which a first background save starts once it is
    durable, still runs."""
    return any(t.name.startswith(SAVE_THREAD_PREFIX) or t.name == WARM_THREAD for t in threading.enumerate())


def cpu_seconds() -> float:
    """CPU time (user + system) of every thread of this process so far, to
    the nanosecond (``os.times()`` counts clock ticks, 10 ms here: a 12 ms
    ``torch.save`` of the smoke test's tiny model read 0)."""
    return time.process_time()


def page_cache_bytes() -> int:
    """The page cache's size (``Cached`` in /proc/meminfo); 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def drop_page_cache() -> None:
    """Write back dirty pages and drop the clean page cache (root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples the RSS in a thread; ``extra`` is the peak over the start."""

    def __enter__(self):
        self.base = rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())
        self.extra = self.peak - self.base


class DoneAt:
    """Polls ``fut.done()`` every 2 ms in a thread: ``at`` is the
    first time it was seen done (``None`` until then). The training loop
    goes on meanwhile and the thread never takes the future's result."""

    def __init__(self, fut) -> None:
        self.at = None
        self._fut = fut
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._fut.done():
            time.sleep(0.002)
        self.at = time.perf_counter()

    def join(self) -> float:
        self._t.join()
        return self.at


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="directory for the files (default: a temporary one in /work or /tmp)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint.async_save")
    ap.add_argument(
        "--keep-bases",
        action="store_true",
        help="Repository(keep_bases=True): background saves keep a copy of what they stored as the next save's bases too",
    )
    ap.add_argument("--rounds", type=int, default=4, help="saves per method (the first full, then deltas)")
    ap.add_argument("--layers", type=int, default=12, help="transformer layers (12: GPT-2 small; fewer for a quick smoke run)")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary size (50257: GPT-2's; smaller for a quick smoke run)")
    ap.add_argument("--n-embd", type=int, default=768, help="model width (768: GPT-2 small's; smaller for a quick smoke run)")
    ap.add_argument(
        "--compute",
        choices=("cpu", "idle"),
        default="cpu",
        help="cpu: forward/backward on the CPU; idle: a sleep as long as one (an accelerator trainer's host)",
    )
    ap.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the machine's page cache before each round (root only): see the module docs",
    )
    ap.add_argument(
        "--no-row-frames",
        action="store_true",
        help="repositories made with Repository.init(row_frames=False): less CPU per first save, a little more stored",
    )
    a = ap.parse_args()

    import torch
    import transformers

    import ckvc

    torch.manual_seed(0)
    base = a.work or ("/work" if os.path.isdir("/work") else None)
    work = tempfile.mkdtemp(prefix="ckvc-bench-py-", dir=base)
    try:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=a.layers, vocab_size=a.vocab, n_embd=a.n_embd))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, model.config.vocab_size, (2, 64))

        # How long optimizer.step() waited for a background copy: the time
        # from the call of opt.step() to this optimizer's own pre-hook,
        # which torch runs after the global ones (ckvc's waits there).
        marks = {}
        opt.register_step_pre_hook(lambda *_: marks.__setitem__("hook", time.perf_counter()))

        fb = []  # forward/backward times while warming up

        def train_step(compute: str = "cpu"):
            t0 = time.perf_counter()
            if compute == "idle":
                time.sleep(sorted(fb)[len(fb) // 2])
            else:
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                fb.append(time.perf_counter() - t0)
            marks["step"] = time.perf_counter()
            opt.step()
            if compute == "cpu":
                opt.zero_grad(set_to_none=True)

        train_step()
        train_step()  # warm: the allocator has seen a whole step
        train_step()
        if a.compute == "idle":
            # The gradients of this last real backward stay for every
            # optimizer step to come.
            loss = model(input_ids=x, labels=x).loss
            loss.backward()

        def timed_step() -> float:
            t0 = time.perf_counter()
            train_step(a.compute)
            return time.perf_counter() - t0

        def steps_until(fut) -> tuple:
            """Train, as a loop would, until ``fut`` is done and ckvc's
            threads have ended (a first background save faults its staging
            buffer in after it is durable, beside the steps that follow),
            at most ``MAX_STEPS`` steps; then wait for it, and that wait
            is lost too. Returns (seconds lost: each step's time over the
            plain step's, or its wait for the background copy in
            optimizer.step() when that is longer, summed over the steps,
            plus the final wait; the first step's wait; steps run; the time
            it was done)."""
            done = DoneAt(fut)
            lost, first_wait, n = 0.0, None, 0
            while (done.at is None or ckvc_busy()) and n < MAX_STEPS:
                delay = timed_step() - base_step
                wait = marks["hook"] - marks["step"]
                first_wait = wait if first_wait is None else first_wait
                lost += max(delay, wait)
                n += 1
            t = time.perf_counter()
            at = done.join()
            lost += max(0.0, at - t)
            return lost, first_wait or 0.0, n, at

        def plain_step() -> tuple:
            """Median time and median CPU time (every thread's) of steps
            with no save running."""
            wall, cpu = [], []
            for _ in range(3):
                c0 = cpu_seconds()
                wall.append(timed_step())
                cpu.append(cpu_seconds() - c0)
            return sorted(wall)[1], sorted(cpu)[1]

        def state():
            return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}

        tensor_bytes = 0
        seen = set()
        for t in [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                tensor_bytes += t.numel() * t.element_size()
        rows = []

        modes = ("blocking", "sync", "background")
        rf = not a.no_row_frames
        kb = True if a.keep_bases else None
        repos = {mode: ckvc.Repository.init(os.path.join(work, f"repo-{mode}"), row_frames=rf, keep_bases=kb) for mode in modes}
        mem_repos = {mode: ckvc.Repository.init(os.path.join(work, f"repo-mem-{mode}"), row_frames=rf, keep_bases=kb) for mode in modes}
        steps, steps_cpu = {}, {}
        cores = len(os.sched_getaffinity(0))
        dcp_ok, dcp_why = False, ""
        if not a.no_dcp:
            try:
                import torch.distributed as dist
                import torch.distributed.checkpoint as dcp

                if not dist.is_initialized():
                    dist.init_process_group(
                        "gloo", init_method=f"file://{os.path.join(work, 'pg')}", rank=0, world_size=1
                    )
                dcp_ok = hasattr(dcp, "async_save")
                if not dcp_ok:
                    dcp_why = "this torch has no torch.distributed.checkpoint.async_save"
            except Exception as e:  # noqa: BLE001
                dcp_why = f"{type(e).__name__}: {e}"

        rounds = range(1, max(1, a.rounds) + 1)
        # Rounds with a memory run: the first save, and one delta (later
        # deltas take the second's path).
        mem_rounds = 2
        cache = {}
        for rnd in rounds:
            if rnd > 1:
                train_step(a.compute)
            if a.drop_caches:
                try:
                    drop_page_cache()
                except OSError as e:
                    sys.exit(f"--drop-caches: cannot drop the page cache ({e}); it needs root")
            cache[rnd] = page_cache_bytes()
            base_step, step_cpu = plain_step()
            steps[rnd], steps_cpu[rnd] = base_step, step_cpu
            s = state()
            # torch.save + fsync
            path = os.path.join(work, f"torch-{rnd}.pt")
            with PeakRss() as m:
                c0 = cpu_seconds()
                t0 = time.perf_counter()
                with open(path, "wb") as f:
                    torch.save(s, f)
                    f.flush()
                    os.fsync(f.fileno())
                fsync_dir(work)
                t1 = time.perf_counter()
                cpu = cpu_seconds() - c0
            rows.append(dict(round=rnd, method="torch.save + fsync", call=t1 - t0, step_delay=0.0, steps=0, stall=t1 - t0, durable=t1 - t0, cpu=cpu, stored=os.path.getsize(path), peak_extra=m.extra))
            os.remove(path)
            # ckvc save(blocking=False), each staging mode on its own repository
            for mode in modes:
                repo = repos[mode]
                s = state()
                before = dir_bytes(repo.path)
                c0 = cpu_seconds()
                if mode == "blocking":
                    # save() returns when durable: the loop waits for all of it
                    t0 = time.perf_counter()
                    c = repo.save(s, step=rnd)
                    t1 = t2 = time.perf_counter()
                    lost, waited, n = 0.0, 0.0, 0
                else:
                    t0 = time.perf_counter()
                    fut = repo.save(s, step=rnd, blocking=False, staging=mode)
                    t1 = time.perf_counter()
                    lost, waited, n, t2 = steps_until(fut)
                    c = fut.result()
                # What the save used: the process's CPU time less the
                # training steps' (each a plain step's).
                cpu = cpu_seconds() - c0 - n * step_cpu
                stored = dir_bytes(repo.path) - before
                s = state()
                # The timed save's staging buffer may still be faulting in
                # (a first background save warms it after it is durable):
                # let it finish, so the RSS measured is this save's alone.
                # result() returns before the save's thread starts that
                # fault-in: wait() joins the thread first (without it, a
                # fault-in that started late was counted in the next save's
                # peak, 1.83-1.92x the state in four of six runs).
                repo.wait()
                join_staging_warm()
                peak_extra = None
                if rnd <= mem_rounds:
                    with PeakRss() as m:
                        if mode == "blocking":
                            mem_repos[mode].save(s, step=rnd)
                        else:
                            mem_repos[mode].save(s, step=rnd, blocking=False, staging=mode).result()
                            # and the staging buffer a first background save
                            # faults in after it is durable
                            mem_repos[mode].wait()
                            join_staging_warm()
                    peak_extra = m.extra
                method = "ckvc save (blocking)" if mode == "blocking" else f"ckvc staging={mode}"
                rows.append(dict(round=rnd, method=method, call=t1 - t0, step_delay=lost, steps=n, waited=waited, stall=t1 - t0 + max(0.0, lost), durable=t2 - t0, cpu=cpu, stored=stored, stored_commit=c.stored_bytes, peak_extra=peak_extra))
            # DCP async_save
            if dcp_ok:
                import torch.distributed.checkpoint as dcp

                ck = os.path.join(work, f"dcp-{rnd}")
                try:
                    c0 = cpu_seconds()
                    t0 = time.perf_counter()
                    f = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ck)
                    t1 = time.perf_counter()
                    delay, _, n, t2 = steps_until(f)
                    f.result()
                    cpu = cpu_seconds() - c0 - n * step_cpu
                    stored = dir_bytes(ck)
                    peak_extra = None
                    if rnd <= mem_rounds:
                        with PeakRss() as m:
                            dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ck + "-mem").result()
                        peak_extra = m.extra
                    rows.append(dict(round=rnd, method="dcp.async_save", call=t1 - t0, step_delay=delay, steps=n, stall=t1 - t0 + max(0.0, delay), durable=t2 - t0, cpu=cpu, stored=stored, peak_extra=peak_extra))
                    shutil.rmtree(ck, ignore_errors=True)
                    shutil.rmtree(ck + "-mem", ignore_errors=True)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
                    dcp_ok, dcp_why = False, f"async_save failed: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}"
            del s

        report = {"compute": a.compute, "state_bytes": tensor_bytes, "plain_step": steps, "plain_step_cpu": steps_cpu, "cores": cores, "page_cache_bytes": cache, "drop_caches": a.drop_caches, "rows": rows, "dcp": dcp_why or "ran single-process (gloo, world size 1)"}
        if a.json:
            print(json.dumps(report, indent=1))
            return 0
        gib = 1 << 30
        shape = "GPT-2 small (GPT2Config defaults)" if (a.layers, a.vocab, a.n_embd) == (12, 50257, 768) else f"GPT-2 of {a.layers} layers, vocabulary {a.vocab}, width {a.n_embd}"
        print(f"state: {shape} + AdamW after one step: {tensor_bytes / gib:.2f} GiB of tensors; work dir {work}")
        if a.compute == "idle":
            print(f"compute idle: each forward/backward is a sleep of {sorted(fb)[len(fb) // 2]:.3f} s (a real one's median); optimizer.step() runs on the CPU")
        else:
            print("compute cpu: forward/backward and optimizer.step() on the CPU, beside any background save")
        dropped = ", dropped before each round (--drop-caches)" if a.drop_caches else ""
        for rnd in rounds:
            print(
                f"round {rnd}: a training step with no save running takes {steps[rnd]:.3f} s and {steps_cpu[rnd]:.3f} CPU-s "
                f"({steps_cpu[rnd] / steps[rnd]:.2f} of the {cores} cores); page cache {cache[rnd] / gib:.1f} GiB{dropped}"
            )
        print(f"{'round':<6} {'method':<26} {'call s':>7} {'steps':>5} {'+steps s':>8} {'waited s':>9} {'stall s':>8} {'durable s':>10} {'cpu s':>6} {'stored MiB':>11} {'peak extra RSS MiB':>19}")
        for r in rows:
            w = f"{r['waited']:>9.3f}" if "waited" in r else f"{'-':>9}"
            rss_mib = f"{r['peak_extra'] / 2**20:>19.1f}" if r["peak_extra"] is not None else f"{'-':>19}"
            print(
                f"{r['round']:<6} {r['method']:<26} {r['call']:>7.3f} {r['steps']:>5} {r['step_delay']:>8.3f} {w} {r['stall']:>8.3f} "
                f"{r['durable']:>10.3f} {r['cpu']:>6.2f} {r['stored'] / 2**20:>11.1f} {rss_mib}"
            )
        print(
            "(steps = training steps run after the call until the save was durable and ckvc's threads had ended (after a\n"
            " first background save, the fault-in of its staging buffer), as a loop goes on. +steps = what they lost: how\n"
            " much longer each took than the median of three with no save running, just before (or its wait in\n"
            " optimizer.step() for the background copy, when longer), summed, plus any wait for the save after\n"
            f" {MAX_STEPS} steps; negative when the machine's load moved more than the save did. waited = the first\n"
            " step's wait for the copy. stall = call + +steps when that is positive, else call. cpu = the process's CPU\n"
            " time from the call until durable (and the steps had ended), less the steps' (a plain step's each).)"
        )
        for rnd in rounds:
            ts = next(r for r in rows if r["round"] == rnd and r["method"].startswith("torch"))
            for ck in (r for r in rows if r["round"] == rnd and r["method"].startswith("ckvc")):
                # The save's CPU time can run no faster than on the cores
                # the training steps leave free (all of them while a
                # blocking save holds the loop): a floor under durable.
                free = cores if ck["method"].endswith("(blocking)") else cores - steps_cpu[rnd] / steps[rnd]
                floor = ck["cpu"] / free if free > 0 else float("inf")
                print(
                    f"round {rnd} {ck['method']}: stall / torch.save+fsync = {ck['stall'] / ts['durable']:.3f} (target <= 0.25), "
                    f"durable / torch.save+fsync = {ck['durable'] / ts['durable']:.2f} (target <= 1.5; "
                    f"its CPU on the {free:.2f} free cores alone: {floor / ts['durable']:.2f})"
                    + (f", peak extra RSS / state = {ck['peak_extra'] / tensor_bytes:.2f} (target <= 1.0)" if ck["peak_extra"] is not None else "")
                )
        if dcp_why:
            print(f"dcp.async_save: {dcp_why}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
