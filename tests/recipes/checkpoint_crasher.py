"""Fault injection for run checkpoints: SIGKILL a process while it writes checkpoints, then check what is left.

Run as ``python checkpoint_crasher.py CHECKPOINTS_DIR NUM_RANDOM_KILLS SEED``; prints one JSON summary line.

One supervisor process imports torch once and forks workers (torch pinned to one thread, so forking is safe).
Each worker saves checkpoints ``latest + 1, latest + 2, ...`` with the real ``save_run_checkpoint`` until the
supervisor kills it with SIGKILL:

- deterministic kills: the worker arms an audit hook (``sys.addaudithook``) that SIGKILLs itself right before
  its k-th filesystem operation (open, mkdir, rename/replace, remove, rmtree, ...) of a save, for every k of one
  save, so the kill lands once before every step of the publish protocol;
- random kills: the worker saves in a loop and is killed after a random delay (anywhere, including inside the
  safetensors/torch.save writers, which issue no audit events).

After each kill the supervisor checks the directory: ``latest`` is a whole line naming a complete checkpoint
whose weights, optimizer state, run state, RNG states and config all load and agree on the step, and the step
never goes backwards. The weights of step N are all equal to N, so a torn file cannot pass.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import torch
import yaml
from miles.recipes.checkpoint import read_latest, save_run_checkpoint
from safetensors.torch import load_file, save_file

FS_EVENTS = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "tempfile.mkdtemp"}
HIDDEN = 256  # 4 x 256 x 256 fp32 weights = 1 MiB of safetensors, plus 2 MiB of Adam moments


class TorchBackend:
    """A plain-torch model + AdamW that writes the same files, with the same writers, as ``FSDP2Backend.save``."""

    def __init__(self, step: int) -> None:
        self.model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.set_step(step)

    def set_step(self, step: int) -> None:
        """Weights all equal to ``step`` after one AdamW step (so the optimizer has state to save)."""
        self.step = step
        for p in self.model.parameters():
            p.grad = torch.ones_like(p)
        self.optimizer.step()
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float(step))

    def save(self, path: Path) -> None:
        (path / "model").mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, path / "model" / "model.safetensors")
        (path / "model" / "config.json").write_text(json.dumps({"hidden": HIDDEN}))
        torch.save({"optimizer": self.optimizer.state_dict()}, path / "optimizer.pt")
        (path / "trainer_state.json").write_text(json.dumps({"step": self.step}))


class Positions:
    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": self.step, "num_prompts": self.step, "seed": 7}


# Built once in the supervisor before forking: the first AdamW step costs seconds of lazy initialization.
BACKEND: TorchBackend | None = None


def worker(checkpoints: Path, kill_at_event: int, count_pipe: int | None) -> None:
    """Save latest+1, latest+2, ... forever; with kill_at_event > 0, SIGKILL self at that fs event of the save."""
    latest = read_latest(checkpoints)
    step = int(latest.name.split("_")[1]) + 1 if latest else 1
    backend = BACKEND
    backend.set_step(step)
    counter = [0]

    def hook(event: str, args: tuple) -> None:
        if event in FS_EVENTS:
            counter[0] += 1
            if counter[0] == kill_at_event:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    while True:
        counter[0] = 0
        save_run_checkpoint(
            checkpoints,
            step,
            backend=backend,
            data_source=Positions(step),
            weight_version=step,
            config={"loop": {"num_steps": 100}},
            keep=2,
        )
        if count_pipe is not None:  # counting run: report the number of fs events of one save, then stop
            os.write(count_pipe, str(counter[0]).encode())
            os._exit(0)
        step += 1
        backend.set_step(step)


def check(checkpoints: Path, previous_step: int) -> tuple[int, list[str]]:
    """The step ``latest`` names and the invariant violations found."""
    problems = []
    latest_file = checkpoints / "latest"
    text = latest_file.read_text() if latest_file.exists() else ""
    if not re.fullmatch(r"step_\d+\n", text):
        return previous_step, [f"latest is {text!r}, not a whole 'step_N' line"]
    checkpoint = checkpoints / text.strip()
    if read_latest(checkpoints) != checkpoint:
        return previous_step, [f"latest names {checkpoint.name}, which is not a complete checkpoint"]
    step = int(checkpoint.name.split("_")[1])
    try:
        weights = load_file(checkpoint / "model" / "model.safetensors")
        optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)["optimizer"]
        run_state = json.loads((checkpoint / "run_state.json").read_text())
        trainer_state = json.loads((checkpoint / "trainer_state.json").read_text())
        json.loads((checkpoint / "rng_rank0.json").read_text())
        config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    except Exception as err:  # noqa: BLE001 - any failure to load is the violation being reported
        return step, [f"{checkpoint.name} does not load: {err!r}"]
    if not all(bool((w == float(step)).all()) for w in weights.values()):
        problems.append(f"{checkpoint.name}: weights are not all {step}")
    if len(optimizer["state"]) != 4:
        problems.append(f"{checkpoint.name}: optimizer state has {len(optimizer['state'])} entries, expected 4")
    if not (run_state["step"] == trainer_state["step"] == run_state["weight_version"] == step):
        problems.append(f"{checkpoint.name}: run/trainer state disagree: {run_state}, {trainer_state}")
    if config != {"loop": {"num_steps": 100}}:
        problems.append(f"{checkpoint.name}: config is {config}")
    if step < previous_step:
        problems.append(f"latest went back from step_{previous_step} to {checkpoint.name}")
    return step, problems


def run_worker(checkpoints: Path, *, kill_at_event: int = 0, kill_after_s: float | None = None) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            worker(checkpoints, kill_at_event, None)
        finally:
            os._exit(1)
    if kill_after_s is not None:
        time.sleep(kill_after_s)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def main() -> None:
    checkpoints, num_random, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    global BACKEND
    torch.set_num_threads(1)
    BACKEND = TorchBackend(0)
    rng = random.Random(seed)
    # One complete save, then count the filesystem events of the next one.
    # Two complete saves in this process (they also import everything a save imports lazily, so forked workers
    # see only the save's own filesystem events), then count the events of a steady-state save (with pruning).
    _one_save(checkpoints, fork=False)
    _one_save(checkpoints, fork=False)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        worker(checkpoints, 0, write_fd)
    os.waitpid(pid, 0)
    num_events = int(os.read(read_fd, 32))
    step, violations = check(checkpoints, 0)
    steps_seen = [step]
    for k in range(1, num_events + 1):
        run_worker(checkpoints, kill_at_event=k)
        step, problems = check(checkpoints, step)
        violations += [f"kill before fs event {k}: {p}" for p in problems]
        steps_seen.append(step)
    for _ in range(num_random):
        delay = rng.uniform(0.02, 0.4)
        run_worker(checkpoints, kill_after_s=delay)
        step, problems = check(checkpoints, step)
        violations += [f"kill after {delay:.3f}s: {p}" for p in problems]
        steps_seen.append(step)
    _one_save(checkpoints, fork=True)  # a clean save after all the crashes removes every leftover
    step, problems = check(checkpoints, step)
    violations += problems
    leftovers = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("."))
    step_dirs = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_"))
    summary = {
        "num_fs_events_per_save": num_events,
        "num_kills": num_events + num_random,
        "steps_seen": steps_seen,
        "final_step": step,
        "violations": violations,
        "leftovers": leftovers,
        "step_dirs": step_dirs,
    }
    sys.stdout.write(json.dumps(summary) + "\n")


def _one_save(checkpoints: Path, *, fork: bool) -> None:
    """Save exactly one checkpoint (latest + 1), in a forked child or in this process."""
    if fork:
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
            return
    latest = read_latest(checkpoints)
    step = int(latest.name.split("_")[1]) + 1 if latest else 1
    BACKEND.set_step(step)
    save_run_checkpoint(
        checkpoints,
        step,
        backend=BACKEND,
        data_source=Positions(step),
        weight_version=step,
        config={"loop": {"num_steps": 100}},
        keep=2,
    )
    if fork:
        os._exit(0)


if __name__ == "__main__":
    main()
