"""``miles train`` for text-to-image flow models: recipes with ``kind: diffusion`` train with Flow-GRPO or
DiffusionNFT (``miles.diffusion.trainer``) and write the run directory the LLM runs write::

    config.yaml  metrics.jsonl  train.log  reward.png
    samples/step_N.png           the held-out eval images at step N (a grid: one row per eval prompt, labelled)
    checkpoints/step_N/          model/ (the flow model), optimizer.pt, run_state.json, rng_rank0.json, config.yaml
    checkpoints/latest

Checkpoints are published whole or not at all (``miles.recipes.checkpoint``); Ctrl-C finishes the step, saves and
stops, and ``miles train --run.name NAME --resume`` continues exactly (the rollout noise depends only on the seed and
the step). ``run.world_size`` > 1 trains in that many spawned processes (FSDP2 over the transformer, rank 0
writing the run directory; ``_run_ranks``). Models: the tiny twin (``tiny-flow``), diffusers
StableDiffusion3Pipeline directories (SD3, SD3.5; the random ``tiny-sd3`` runs that path here), QwenImagePipeline
directories (Qwen-Image; the random ``tiny-qwen-image``), or a flow model a run saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import yaml
from miles.diffusion.config import FlowGRPOConfig
from miles.diffusion.models import (
    FLOW_META,
    PIPELINES,
    FlowModel,
    load_flow_model,
    pipeline_class,
    qwen_image_flow_model,
    save_flow_model,
    sd3_flow_model,
    tiny_flow_model,
)
from miles.diffusion.rewards import IMAGE_REWARDS, ClipScore, prompt_colour
from miles.diffusion.sglang import SGLangDiffusionEngine, SGLangDiffusionWeightSink
from miles.diffusion.trainer import FlowGRPOTrainer, ImageReward, RewardFailed
from miles.sync.errors import WeightUpdateError
from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

TINY_FLOW = "tiny-flow"
TINY_SD3 = "tiny-sd3"
TINY_QWEN_IMAGE = "tiny-qwen-image"
REWARD_SIGNATURE = "(prompts: list[str], images: numpy uint8 [B, H, W, 3]) -> B floats"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FlowModelConfig(_Section):
    """The flow model trained."""

    path: str = Field(TINY_FLOW, description=f"'{TINY_FLOW}' (the random tiny twin on pixels), '{TINY_SD3}' (a random "
                      f"SD3.5-shaped diffusers pipeline), '{TINY_QWEN_IMAGE}' (a random Qwen-Image-shaped one), a "
                      "local diffusers StableDiffusion3Pipeline (SD3, SD3.5) or QwenImagePipeline (Qwen-Image) "
                      "directory, or a flow model a run saved (a checkpoint's model/, or its export).")  # fmt: skip
    seed: int = Field(0, description=f"Seeds {TINY_FLOW}'s random weights.")
    resolution: int | None = Field(None, gt=0, description="Pipelines: image side in pixels (default: SD3 the "
                                   "transformer's sample_size x the VAE's scale, Qwen-Image 1024, "
                                   f"{TINY_QWEN_IMAGE} 16).")  # fmt: skip
    max_sequence_length: int = Field(256, gt=0, description="Pipelines: text tokens per prompt (SD3: T5's; "
                                     "Qwen-Image: at most 1024).")  # fmt: skip
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model trains and samples: auto = "
                                                   "the GPU when one is visible, else the CPU.")  # fmt: skip
    frozen_dtype: Literal["float32", "bfloat16"] = Field("float32", description="The frozen parts' dtype (text "
                                                         "encoders, VAE): bfloat16 halves their memory; prompt "
                                                         "embeddings and images still reach the trainer in "
                                                         "float32.")  # fmt: skip


class ImageRewardConfig(_Section):
    """The reward of each image: a built-in one by name, or a function of yours."""

    name: Literal["jpeg_compressibility", "jpeg_incompressibility", "named_colour", "clip_score"] | None = Field(
        "jpeg_compressibility",
        description="jpeg_compressibility / jpeg_incompressibility: minus / plus the JPEG size in kB (DDPO); "
        "named_colour: how close the pixels are to the colour the prompt names (red, green, blue, yellow, ...); "
        "clip_score: PickScore / CLIP's logit for (image, prompt) from the local model in reward.model_path.",
    )
    model_path: str = Field("", description="clip_score: a local CLIPModel directory with its processor (PickScore_v1, "
                            "a CLIP model); Miles downloads nothing.")  # fmt: skip
    path: str = Field("", description="module:function or file.py:function, (prompts, images [B, H, W, 3] uint8 "
                      "numpy) -> B floats; replaces reward.name.")  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _path_replaces_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("path"):  # the config records what runs: the function, no name
            data = {**data, "name": None}
        return data

    @model_validator(mode="after")
    def _one(self) -> ImageRewardConfig:
        from miles.core.plugins import check_plugin_path

        check_plugin_path("reward.path", self.path, "my_rewards.py:score")
        if not self.path and self.name is None:
            raise ValueError("reward: set reward.name (a built-in reward) or reward.path (module:function)")
        if (self.name == "clip_score") != bool(self.model_path):
            raise ValueError(
                "reward.model_path goes with reward.name clip_score (a local PickScore / CLIP directory): set both, "
                "or neither"
            )
        return self


class PromptsConfig(_Section):
    """The prompts: each step takes algorithm.prompts_per_step of them in order, wrapping around."""

    prompts: list[str] = Field(default_factory=list, min_length=1, description="Training prompts.")


class FlowEvalConfig(_Section):
    """Held-out evaluation: one deterministic (ODE) image per eval prompt from noise no training step draws."""

    prompts: list[str] = Field(default_factory=list, description="Eval prompts; empty = the training prompts.")
    images_per_prompt: int = Field(4, ge=1, description="Images per eval prompt (a row of the samples grid).")
    interval: int = Field(10, ge=0, description="Evaluate every N steps (and at step 0 and the end); 0 = never.")
    seed: int = Field(1_000_000_007, description="The eval noise's seed (apart from algorithm.seed's streams).")


class FlowLoopConfig(_Section):
    """How long, and how often to save."""

    num_steps: int = Field(40, ge=1, description="Flow-GRPO steps (each: sample, reward, train, push weights).")
    save_interval: int = Field(10, ge=0, description="Checkpoint every N steps (and after the last; Ctrl-C also "
                               "saves); 0 = only at the end.")  # fmt: skip
    keep_checkpoints: int = Field(2, ge=0, description="Checkpoints kept (0 = all).")


class FlowEngineConfig(_Section):
    """Who samples the rollouts."""

    type: Literal["embedded", "sglang"] = Field("embedded", description="embedded: a copy of the transformer in the "
                                                "trainer's process; sglang: SGLang-Diffusion servers (or miles "
                                                "serve-diffusion) at engine.urls, through their /rollout/generate "
                                                "and /update_weights_from_disk (one trainer process).")  # fmt: skip
    urls: list[str] = Field(default_factory=list, description="sglang: the servers, http://host:port; each step's "
                            "prompts go to them in turn. They serve the model the run trains.")  # fmt: skip
    weights_dir: str = Field("", description="sglang: where each weight version is written for the servers to load "
                             "(a path they see the same way; 2 versions stay); empty: a temporary directory, "
                             "removed when the run ends (servers on this machine only).")  # fmt: skip
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="sglang: the servers' transformer dtype "
                                                  "(pushed weights are checksummed in it).")  # fmt: skip
    timeout_s: float = Field(600.0, gt=0, description="sglang: seconds one request (a prompt's group of images, "
                             "or one weight load) may take.")  # fmt: skip


class FlowRunConfig(_Section):
    """Outputs and process settings."""

    name: str = Field("", description="Run directory name under run.dir; empty = '<recipe>-<timestamp>'.")
    dir: str = Field("runs", description="Parent directory of run directories.")
    num_threads: int | None = Field(None, ge=1, description="torch threads (None: torch's default).")
    progress: bool = Field(True, description="Show a console progress bar with the key metrics.")
    world_size: int = Field(1, ge=1, description="Data-parallel ranks on this machine, one process each: FSDP2 over "
                            "the transformer, each rank samples its part of every mini-batch (gloo on the CPU, NCCL "
                            "with one GPU per rank); rank 0 writes the run directory.")  # fmt: skip


class DiffusionConfig(_Section):
    """A ``kind: diffusion`` recipe: Flow-GRPO or DiffusionNFT on a text-to-image flow model."""

    kind: Literal["diffusion"] = Field("diffusion", description="Marks a diffusion recipe.")
    model: FlowModelConfig = Field(default_factory=FlowModelConfig, description="The flow model.")
    algorithm: FlowGRPOConfig = Field(default_factory=FlowGRPOConfig, description="The loss and its settings.")
    reward: ImageRewardConfig = Field(default_factory=ImageRewardConfig, description="The image reward.")
    data: PromptsConfig = Field(description="The training prompts.")
    eval: FlowEvalConfig = Field(default_factory=FlowEvalConfig, description="Held-out evaluation.")
    loop: FlowLoopConfig = Field(default_factory=FlowLoopConfig, description="Steps and checkpoints.")
    engine: FlowEngineConfig = Field(default_factory=FlowEngineConfig, description="Who samples the rollouts.")
    run: FlowRunConfig = Field(default_factory=FlowRunConfig, description="Outputs and process settings.")

    @model_validator(mode="after")
    def _ranks_split_the_batch(self) -> DiffusionConfig:
        algo, ranks = self.algorithm, self.run.world_size
        if algo.batch_size % (algo.updates_per_rollout * ranks):
            raise ValueError(
                f"algorithm.prompts_per_step x group_size ({algo.batch_size}) must split into "
                f"algorithm.updates_per_rollout ({algo.updates_per_rollout}) x run.world_size ({ranks}) equal parts: "
                "each rank trains an equal part of every mini-batch"
            )
        if self.engine.type == "sglang" and not self.engine.urls:
            raise ValueError("engine.urls is empty: engine.type sglang samples on SGLang-Diffusion servers; give "
                             "their addresses (--engine.urls http://127.0.0.1:30000)")  # fmt: skip
        if self.engine.type == "sglang" and ranks > 1:
            raise ValueError("engine.type sglang trains in one process: set run.world_size 1 (the servers sample)")
        bad = [url for url in self.engine.urls if not url.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"engine.urls: {bad[0]!r} has no scheme; write http://{bad[0]}")
        given = [key for key in ("urls", "weights_dir") if getattr(self.engine, key)]
        if self.engine.type == "embedded" and given:
            raise ValueError(f"engine.{given[0]} is set but engine.type is embedded (the trainer samples in its own "
                             "process); add --engine.type sglang to sample on those servers")  # fmt: skip
        return self


def is_diffusion(raw: dict[str, Any]) -> bool:
    """Whether a recipe's raw mapping is a diffusion recipe (``kind: diffusion``)."""
    return raw.get("kind") == "diffusion"


class _PromptCycle:
    """The training prompts in order, wrapping around; its position is checkpointed (``DataSource``'s state)."""

    def __init__(self, prompts: list[str]) -> None:
        self.prompts, self.position = prompts, 0

    def take(self, n: int) -> list[str]:
        out = [self.prompts[(self.position + i) % len(self.prompts)] for i in range(n)]
        self.position += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class _CheckpointedTrainer:
    """The trainer as ``save_run_checkpoint`` / ``restore_run_checkpoint`` see a backend: ``model/`` (the flow model
    directory, loadable by ``load_flow_model``; with LoRA the merged transformer), ``optimizer.pt`` (tensors and
    numbers: weights_only loads; with LoRA also the adapters, ``adapters``, which a resume loads onto the run's model
    as loaded)."""

    def __init__(self, trainer: FlowGRPOTrainer, model: FlowModel) -> None:
        self.trainer, self.model = trainer, model

    def save(self, directory: Path | None) -> None:
        """Write the checkpoint files into ``directory``. Collective on several ranks: each calls it, rank 0 with
        the directory, the others with None (they gather with it and write nothing).
        Raises: FloatingPointError naming a trained tensor that is not finite (nothing written)."""
        state = self.trainer.state_dict()
        for name, tensor in state["transformer"].items():
            if not bool(torch.isfinite(tensor).all()):
                raise FloatingPointError(f"the transformer's {name} is not finite: not saving it")
        with self.trainer.trained_transformer() as transformer:
            if directory is not None:
                save_flow_model(dataclasses.replace(self.model, transformer=transformer), Path(directory) / "model")
        if directory is None:
            return
        transformer = state.pop("transformer")
        if self.trainer.config.lora is not None:
            state["adapters"] = transformer
        torch.save(state, Path(directory) / "optimizer.pt")

    def load(self, directory: Path) -> None:
        optimizer_path = Path(directory) / "optimizer.pt"
        state = torch.load(optimizer_path, weights_only=True)
        if self.trainer.config.lora is not None:
            self.trainer.load_state_dict({**state, "transformer": state.pop("adapters")})
            return
        loaded = load_flow_model(Path(directory) / "model")
        self.trainer.load_state_dict({**state, "transformer": loaded.transformer.state_dict()})


def build_reward(cfg: DiffusionConfig, device: torch.device | str = "cpu") -> ImageReward:
    """The reward named by ``cfg.reward`` (a learned one on ``device``). Raises: ValueError / ImportError /
    TypeError naming reward.path, OSError naming reward.model_path."""
    from miles.core.plugins import load_plugin

    if cfg.reward.path:
        return load_plugin(cfg.reward.path, key="reward.path", num_positional=2, signature=REWARD_SIGNATURE)
    if cfg.reward.name == "named_colour":  # every prompt must name its colour: say which does not, before training
        for key, prompts in (("data.prompts", cfg.data.prompts), ("eval.prompts", cfg.eval.prompts)):
            for prompt in prompts:
                try:
                    prompt_colour(prompt)
                except ValueError as err:
                    raise ValueError(f"{key}: {err} (reward.name is named_colour)") from None
    if cfg.reward.name == "clip_score":
        path = Path(cfg.reward.model_path).expanduser()
        fix = "pass a downloaded PickScore / CLIP directory (a CLIPModel with its processor)"
        if not (path / "config.json").is_file():
            raise ValueError(
                f"reward.model_path {cfg.reward.model_path!r} is not a local model directory (no config.json); {fix}"
            )
        try:
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
        except (ValueError, AttributeError):
            model_type = None
        if model_type != "clip":
            raise ValueError(
                f"reward.model_path {cfg.reward.model_path!r} holds a {model_type!r} model, not a CLIP model; {fix}"
            )
        try:
            return ClipScore(str(path), device=device)
        except (OSError, ValueError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"reward.model_path {cfg.reward.model_path!r} could not be loaded ({first}); {fix}"
            ) from err
    return IMAGE_REWARDS[cfg.reward.name]


def build_model(cfg: DiffusionConfig) -> FlowModel:
    """The flow model of ``cfg.model`` (``build_flow_model``)."""
    return build_flow_model(cfg.model)


def build_flow_model(section: FlowModelConfig, *, path_key: str = "model.path") -> FlowModel:
    """The flow model ``section`` names, its frozen parts in ``frozen_dtype``.

    Args: section: the model's settings; path_key: how errors name ``section.path`` (``--model`` for
        ``miles serve-diffusion``).
    Raises: ValueError naming ``path_key`` when the path is none of the kinds it takes.
    """
    try:
        model = _build_model(section, path_key)
    except ValueError as err:  # a pipeline builder's argument: name the config key and its flag
        for key in ("resolution", "max_sequence_length"):
            if str(err).startswith(f"{key} "):
                flag = key.replace("_", "-")
                raise ValueError(f"model.{key} [--model.{flag}]: {str(err).removeprefix(key + ' ')}") from None
        raise
    return model.cast_frozen(getattr(torch, section.frozen_dtype))


def _build_model(section: FlowModelConfig, path_key: str) -> FlowModel:
    if section.path == TINY_FLOW:
        return tiny_flow_model(seed=section.seed)
    sizes = dict(resolution=section.resolution, max_sequence_length=section.max_sequence_length)
    if section.path == TINY_SD3:
        from miles.recipes.models.tiny_sd3 import ensure_tiny_sd3

        return sd3_flow_model(ensure_tiny_sd3(), **sizes)
    if section.path == TINY_QWEN_IMAGE:
        from miles.recipes.models.tiny_qwen_image import RESOLUTION, ensure_tiny_qwen_image

        return qwen_image_flow_model(ensure_tiny_qwen_image(), **(sizes | {"resolution": sizes["resolution"] or
                                                                          RESOLUTION}))  # fmt: skip
    path = Path(section.path).expanduser()
    if (path / FLOW_META).is_file():
        return load_flow_model(path)
    kind = pipeline_class(path)
    for name, build in PIPELINES.values():
        if kind == name:
            return build(path, **sizes)
    if kind is not None:
        raise ValueError(
            f"{path_key} {section.path!r} holds a diffusers {kind}; Miles trains StableDiffusion3Pipeline (SD3, "
            "SD3.5) and QwenImagePipeline (Qwen-Image) directories"
        )
    raise ValueError(
        f"{path_key} {section.path!r} is neither {TINY_FLOW!r}, {TINY_SD3!r}, {TINY_QWEN_IMAGE!r}, a diffusers "
        f"StableDiffusion3Pipeline or QwenImagePipeline directory (model_index.json) nor a flow model a run saved "
        f"({FLOW_META}); Miles does not download models"
    )


def dry_run_plan(cfg: DiffusionConfig) -> str:
    """What ``miles train --dry-run`` says about a diffusion run, one line each: the processes, the model (and
    whether its path is there), device and precision, the algorithm's batch, the loop. Reads config.json /
    model_index.json files only; builds nothing."""
    ranks = cfg.run.world_size
    where = "in this process; it starts nothing else"
    if ranks > 1:
        per_rank = ", one GPU each" if cfg.model.device == "cuda" else ""
        where = f"in {ranks} rank processes it spawns (FSDP2 over the transformer{per_rank}); nothing else"
    path = Path(cfg.model.path).expanduser()
    if cfg.model.path in (TINY_FLOW, TINY_SD3, TINY_QWEN_IMAGE):
        model = f"{cfg.model.path} (random, built offline into the model cache)"
    elif (path / FLOW_META).is_file():
        model = f"{path} (a flow model a run saved)"
    elif pipeline_class(path) is not None:
        model = f"{path} (a diffusers {pipeline_class(path)})"
    else:
        model = f"{path} NOT FOUND here: miles train would stop; pass a local diffusers pipeline directory"
    try:
        device = str(resolve_device(cfg.model.device))
    except ValueError:
        device = f"{cfg.model.device} (no GPU visible here: miles train would stop)"
    a = cfg.algorithm
    trained = f"{a.train_steps} trained" if a.train_steps is not None else "all trained"
    lora = f", LoRA r {a.lora.rank} on {len(a.lora.target_modules)} module names" if a.lora is not None else ""
    evals = f"eval every {cfg.eval.interval}" if cfg.eval.interval else "no eval"
    precision = f"trained float32, sampling copy {a.rollout_dtype}, text encoders and VAE {cfg.model.frozen_dtype}"
    batch = f"{a.prompts_per_step} prompts x {a.group_size} images a step, {a.num_steps} denoising steps ({trained})"
    every = cfg.loop.save_interval or cfg.loop.num_steps
    lines = [
        f"# miles train --dry-run: a {cfg.kind} run trains {where}",
        f"model: {model}",
        f"device: {device}; precision: {precision}",
        f"algorithm: {a.loss}, {batch}{lora}",
        f"loop: {cfg.loop.num_steps} steps, a checkpoint every {every}, {evals}",
    ]
    if cfg.engine.type == "sglang":
        weights = cfg.engine.weights_dir or "a temporary directory"
        lines.insert(2, f"engine: SGLang-Diffusion API at {', '.join(cfg.engine.urls)} (started by you, not by miles "
                        f"train); weight versions written to {weights}")  # fmt: skip
    return "\n".join(lines) + "\n"


def resolve_device(device: str) -> torch.device:
    """``model.device`` as a torch device. Raises: ValueError for cuda without a visible GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "model.device is cuda but no GPU is visible (torch.cuda.is_available() is False); use --model.device cpu "
            "or auto (a recipe with a tiny twin runs its settings on the CPU with --tiny)"
        )
    return torch.device("cuda" if device == "auto" and torch.cuda.is_available() else device.replace("auto", "cpu"))


def image_grid(images: np.ndarray, *, columns: int) -> np.ndarray:
    """Tile images [N, H, W, 3] uint8 into a grid [rows * (H + 2), columns * (W + 2), 3] with a 2-pixel white
    border after each image; N need not fill the last row (white)."""
    n, h, w, _ = images.shape
    rows = math.ceil(n / columns)
    grid = np.full((rows * (h + 2), columns * (w + 2), 3), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        grid[r * (h + 2) : r * (h + 2) + h, c * (w + 2) : c * (w + 2) + w] = image
    return grid


def save_png(
    pixels: np.ndarray, path: Path, *, scale: int = 1, row_labels: list[str] | None = None, row_height: int = 0
) -> None:
    """Write an RGB uint8 array as a PNG, each pixel ``scale`` x ``scale`` (tiny images stay visible), with
    ``row_labels`` written left of each band of ``row_height`` (unscaled) pixels; temp file, then renamed."""
    from PIL import Image, ImageDraw

    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(pixels).resize((pixels.shape[1] * scale, pixels.shape[0] * scale), Image.NEAREST)
    if row_labels:
        width = 8 + 6 * max(len(label) for label in row_labels)  # PIL's default bitmap font: ~6 px a character
        labelled = Image.new("RGB", (image.width + width, image.height), (255, 255, 255))
        labelled.paste(image, (width, 0))
        draw = ImageDraw.Draw(labelled)
        for row, label in enumerate(row_labels):
            draw.text((4, row * row_height * scale + 2), label, fill=(0, 0, 0))
        image = labelled
    tmp = path.with_name(f".{path.name}.tmp")
    image.save(tmp, format="PNG")
    tmp.replace(path)


def run_diffusion(
    cfg: DiffusionConfig, run_dir: Path, *, resume_from: Path | None = None, replace_existing: bool = False
):
    """Train per ``cfg`` (module docstring) and return ``miles.recipes.run.RunResult``; with ``run.world_size`` > 1
    in that many processes (``_run_ranks``).

    Raises: RunSetupError for a model or reward that cannot be built (nothing written yet); RunInputError when the
    reward fails on the images; RunFailed when a rank dies or an engine server fails or refuses a push;
    KeyboardInterrupt on a second Ctrl-C (the last checkpoint stays).
    """
    if cfg.run.world_size > 1:
        return _run_ranks(cfg, run_dir, resume_from=resume_from, replace_existing=replace_existing)
    return _train(cfg, run_dir, resume_from=resume_from, replace_existing=replace_existing)


def _train(
    cfg: DiffusionConfig,
    run_dir: Path,
    *,
    resume_from: Path | None = None,
    replace_existing: bool = False,
    mesh: Any = None,
):
    """``run_diffusion`` in this process: alone (``mesh`` None), or as one of the ranks of ``mesh`` (a 1-D
    ``DeviceMesh``): every rank builds and trains, rank 0 alone writes the run directory and the console."""
    from diffusers.utils import logging as diffusers_logging
    from miles.recipes.checkpoint import restore_run_checkpoint, save_run_checkpoint, write_atomic
    from miles.recipes.interrupts import StopRequest
    from miles.recipes.run import (
        RunFailed,
        RunInputError,
        RunResult,
        RunSetupError,
        _drop_metrics_after,
        _remove_run_dir,
        _run_log,
    )
    from miles.recipes.sinks import ConsoleSink, JsonlSink, plot_rewards
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading bars; the console sink owns the progress bar
    diffusers_logging.disable_progress_bar()
    rank = mesh.get_local_rank() if mesh is not None else 0
    writer = rank == 0
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)

    signals = [None, "SIGINT", "SIGTERM"]

    def agreed(requested: str | None) -> str | None:  # a stop every rank takes at the same step, and its signal
        if mesh is None:
            return requested
        wire = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else None  # NCCL
        value = torch.tensor([float(signals.index(requested))], device=wire)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
        return signals[int(value.item())]

    with _run_log(run_dir) if writer else contextlib.nullcontext(lambda: None) as start_log:
        if resume_from is not None:  # the checkpoint's transformer loads into this model: it must be the same one
            saved_cfg = yaml.safe_load((Path(resume_from) / "config.yaml").read_text())
            shape = ("rank", "alpha", "use_rslora", "target_modules")  # what the saved adapters compute
            lora = cfg.algorithm.lora.model_dump(mode="json") if cfg.algorithm.lora is not None else None
            saved_lora = saved_cfg.get("algorithm", {}).get("lora")
            if (lora is None) != (saved_lora is None):
                now, then = ("off", f"LoRA (rank {saved_lora['rank']})") if lora is None else ("on", "full fine-tuning")
                raise RunSetupError(
                    f"algorithm.lora is {now} but the checkpoint {resume_from} trained with {then}: a resumed run "
                    f"keeps it; to go on otherwise, start a new run with --model.path {Path(resume_from) / 'model'}"
                )
            changed = [k for k in shape if lora is not None and lora[k] != saved_lora.get(k)]
            if changed:
                key = changed[0]
                raise RunSetupError(
                    f"algorithm.lora.{key} is {lora[key]!r} but the checkpoint {resume_from} trained with "
                    f"{saved_lora.get(key)!r}: a resumed run keeps its adapters' rank, alpha and targets; drop "
                    f"--algorithm.lora.{key.replace('_', '-')}, or start a new run with --model.path "
                    f"{Path(resume_from) / 'model'}"
                )
            recorded = saved_cfg.get("model", {})
            for key in ("path", "resolution", "seed", "max_sequence_length"):
                if recorded.get(key) != getattr(cfg.model, key):
                    raise RunSetupError(
                        f"model.{key} is {getattr(cfg.model, key)!r} but the checkpoint {resume_from} trained "
                        f"{recorded.get(key)!r}: a resumed run keeps its model; to train that checkpoint's model on "
                        f"another setting, start a new run with --model.path {Path(resume_from) / 'model'}"
                    )
        try:
            device = resolve_device(cfg.model.device)
            if mesh is not None and device.type == "cuda":
                device = torch.device("cuda", rank)
            reward = build_reward(cfg, device)
            model = build_model(cfg).to(device)
        except (ValueError, ImportError, AttributeError, TypeError, OSError) as err:
            raise RunSetupError(" ".join(str(err).split())) from err
        logger.info(
            "loaded %s on %s: transformer %.2f M parameters, latents %s",
            cfg.model.path, device, sum(p.numel() for p in model.transformer.parameters()) / 1e6, model.latent_shape,
        )  # fmt: skip
        if model.schedule is not None:
            logger.info(
                "schedule: the pipeline's own (sigmas %s for %d steps); algorithm.shift is not used",
                [round(float(s), 4) for s in model.schedule(cfg.algorithm.num_steps)], cfg.algorithm.num_steps,
            )  # fmt: skip
        engine, sink = _engine(cfg) if cfg.engine.type == "sglang" else (None, None)

        def close_engine() -> None:
            if engine is not None:
                engine.close()
                if not cfg.engine.weights_dir:  # the temporary one: the servers hold the weights they loaded
                    shutil.rmtree(sink.writer.root, ignore_errors=True)

        try:
            trainer = FlowGRPOTrainer(model, cfg.algorithm, reward, mesh=mesh, engine=engine, weight_sink=sink)
        except ValueError as err:  # algorithm.lora.target_modules that match nothing
            close_engine()
            raise RunSetupError(" ".join(str(err).split())) from err
        except WeightUpdateError as err:  # the first push: the servers are not there, or serve another model
            close_engine()
            raise RunSetupError(f"engine.urls: {err}") from err
        if cfg.algorithm.rollout_dtype != "float32" or cfg.model.frozen_dtype != "float32" or engine is not None:
            sampler = f"the sampling copy {cfg.algorithm.rollout_dtype}"
            if engine is not None:
                sampler = f"rollouts on the servers ({cfg.engine.dtype}), evaluation on an in-process copy "
                sampler += cfg.algorithm.rollout_dtype
            logger.info(
                "precision: the trained transformer float32, %s, text encoders and VAE %s; old log-probs: %s",
                sampler, cfg.model.frozen_dtype,
                "the trainer's float32 recompute" if trainer.recompute_old_log_probs else "the sampler's",
            )  # fmt: skip
        if cfg.algorithm.lora is not None:
            lora, params = cfg.algorithm.lora, list(trainer.policy.named_parameters())
            adapters = sum(p.numel() for n, p in params if ".lora_" in n)
            logger.info(
                "algorithm.lora: %d adapted layers (rank %d, alpha %g), %.1f k adapter weights train, the %.2f M of "
                "the transformer stay as loaded", sum(".lora_A." in n for n, _ in params), lora.rank, lora.alpha,
                adapters / 1e3, sum(p.numel() for n, p in params if ".lora_" not in n) / 1e6,
            )  # fmt: skip
        prompts = _PromptCycle(list(cfg.data.prompts))
        eval_prompts = list(cfg.eval.prompts or cfg.data.prompts)
        checkpointed = _CheckpointedTrainer(trainer, model)
        config_dict = cfg.model_dump(mode="json")
        if writer:
            if replace_existing and run_dir.is_dir():
                _remove_run_dir(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            start_log()
            write_atomic(run_dir / "config.yaml", yaml.safe_dump(config_dict, sort_keys=False))
        checkpoints = run_dir / "checkpoints"
        saved: list[Path] = []
        start_step = 0
        if resume_from is not None:
            state = restore_run_checkpoint(Path(resume_from), backend=checkpointed, data_source=prompts)
            start_step = state.step
            if writer:
                _drop_metrics_after(run_dir / "metrics.jsonl", start_step)
            saved.append(Path(resume_from))
            logger.info(
                "resumed from %s at step %d (weights v%d)", resume_from, start_step, trainer.receiver.weight_version
            )
        console = ConsoleSink(cfg.loop.num_steps, initial=start_step, enabled=cfg.run.progress and writer)
        jsonl = JsonlSink(run_dir / "metrics.jsonl") if writer else None
        stop = StopRequest()

        def log(metrics: dict[str, float], step: int) -> None:
            if jsonl is not None:
                jsonl.log(metrics, step)
                console.log(metrics, step)

        def evaluate(step: int) -> None:
            rows = [p for p in eval_prompts for _ in range(cfg.eval.images_per_prompt)]
            score, images = trainer.evaluate(rows, seed=cfg.eval.seed)
            if not writer:
                return
            grid = image_grid(images, columns=cfg.eval.images_per_prompt)
            scale = max(1, 64 // images.shape[1])  # tiny images enlarged to ~64 px, large ones as they are
            save_png(grid, run_dir / "samples" / f"step_{step}.png", scale=scale, row_labels=eval_prompts,
                     row_height=images.shape[1] + 2)  # fmt: skip
            log({"eval/reward": score}, step)

        def save(step: int) -> None:
            if not writer:  # gathers the state with rank 0
                checkpointed.save(None)
                return
            with stop.protect():
                saved.append(
                    save_run_checkpoint(
                        checkpoints,
                        step,
                        backend=checkpointed,
                        data_source=prompts,
                        weight_version=trainer.receiver.weight_version,
                        config=config_dict,
                        keep=cfg.loop.keep_checkpoints,
                    )  # fmt: skip
                )
            logger.info("saved checkpoint %s", saved[-1])

        gap_limit = {"float32": 1e-3, "bfloat16": 1e-2}[cfg.engine.dtype]  # measured same-model gaps: < 1e-6, ~2e-3
        warned = []

        def check_engine_gap(metrics: dict[str, float]) -> None:
            gap = metrics.get("train_rollout_logprob_max_abs_diff")
            if engine is None or gap is None or gap <= gap_limit or warned:
                return
            warned.append(gap)
            logger.warning(
                "the servers' log-probs differ from the trainer's by up to %.2g (expected below %g with %s servers): "
                "do they serve the model this run trains (text encoders, VAE, scheduler: a push carries the "
                "transformer only)?", gap, gap_limit, cfg.engine.dtype,
            )  # fmt: skip

        def engine_failed(err: Exception, step: int, position: dict[str, Any]) -> str:
            """Save where the trainer stands after an engine failure in step ``step`` + 1 (it is healthy): before
            that step when its rollout failed (its prompts go back), after it when only the push failed."""
            done = trainer.steps_done
            if done == step:
                prompts.load_state_dict(position)
            if done > 0 and not (saved and saved[-1].name == f"step_{done}"):
                save(done)
            kept = f"checkpoint step_{done} holds {done} step(s)" if done else "no step was completed"
            return f"engine ({cfg.engine.type}) failed in step {step + 1}: {str(err).rstrip('.')}; {kept}"

        step, stopping = start_step, None
        try:
            with stop:
                if start_step == 0 and cfg.eval.interval:
                    evaluate(0)
                stopping = agreed(stop.requested)
                while step < cfg.loop.num_steps and not stopping:
                    t0 = time.perf_counter()
                    position = prompts.state_dict()
                    try:
                        metrics = trainer.step(prompts.take(cfg.algorithm.prompts_per_step))
                    except (ConnectionError, WeightUpdateError) as err:  # a server went away or refused a push
                        raise RunFailed(engine_failed(err, step, position)) from err
                    step += 1
                    metrics["time/step"] = time.perf_counter() - t0
                    log(metrics, step)
                    check_engine_gap(metrics)
                    last = step == cfg.loop.num_steps
                    if cfg.eval.interval and (step % cfg.eval.interval == 0 or last):
                        evaluate(step)
                    stopping = agreed(stop.requested)
                    if last or stopping or (cfg.loop.save_interval and step % cfg.loop.save_interval == 0):
                        save(step)
        except RewardFailed as err:  # in a training step or an evaluation
            raise RunInputError(
                f"reward.{'path' if cfg.reward.path else 'name'} ({cfg.reward.path or cfg.reward.name}): {err}"
            ) from err
        finally:
            close_engine()
            console.close()
            if jsonl is not None:
                jsonl.close()
            if jsonl is not None and (run_dir / "metrics.jsonl").stat().st_size:
                with contextlib.suppress(Exception):  # a plot must not hide how the run ended
                    plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png", ylim=None)
        if step < cfg.loop.num_steps:
            logger.info("stopped by %s after step %d of %d", stopping, step, cfg.loop.num_steps)
    return RunResult(
        run_dir=run_dir,
        steps_done=step,
        num_steps=cfg.loop.num_steps,
        checkpoint=saved[-1] if saved else None,
        stopped_by=stopping if step < cfg.loop.num_steps else None,
    )


def _engine(cfg: DiffusionConfig) -> tuple[SGLangDiffusionEngine, SGLangDiffusionWeightSink]:
    """The SGLang-Diffusion servers of ``cfg.engine`` and the sink that pushes weights into them (not into the run
    directory: nothing is written there before the run starts)."""
    engine = SGLangDiffusionEngine(cfg.engine.urls, timeout_s=cfg.engine.timeout_s)
    if cfg.engine.weights_dir:
        root = Path(cfg.engine.weights_dir).expanduser().absolute()
    else:
        root = Path(tempfile.mkdtemp(prefix="miles-engine-weights-"))
    sink = SGLangDiffusionWeightSink(engine, root=root, dtype=getattr(torch, cfg.engine.dtype))
    logger.info("engine: SGLang-Diffusion API at %s; weight versions written to %s", ", ".join(engine.urls), root)
    return engine, sink


def _run_ranks(cfg: DiffusionConfig, run_dir: Path, *, resume_from: Path | None, replace_existing: bool):
    """``run_diffusion`` in ``run.world_size`` processes (spawned, one per rank, as torchrun would start them) that
    this one supervises: Ctrl-C / SIGTERM are passed on to them (every rank stops at the same step and rank 0
    saves); when one fails the others are stopped, and its error is raised here as one process would raise it.

    Raises: as ``run_diffusion``; RunSetupError when there are fewer GPUs than ranks; RunFailed naming a rank that
    died without a word (killed, out of memory).
    """
    import multiprocessing
    import os
    import queue as queues
    import signal

    from miles.recipes.run import RunFailed, RunInputError, RunResult, RunSetupError
    from miles.rollout.engines.server import free_port

    world = cfg.run.world_size
    try:
        device = resolve_device(cfg.model.device)
    except ValueError as err:
        raise RunSetupError(str(err)) from None
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise RunSetupError(f"run.world_size {world} needs one GPU per rank; {torch.cuda.device_count()} are visible")
    if cfg.run.num_threads is None:  # ranks share the cores: each takes its part, not all of them
        threads = max(1, (os.cpu_count() or 1) // world)
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"num_threads": threads})})
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    args = (world, address, device.type, cfg.model_dump(mode="json"), str(run_dir),
            str(resume_from) if resume_from else None, replace_existing, reports, os.getpid())  # fmt: skip
    ranks = [
        context.Process(target=_rank_process, args=(rank, *args), name=f"miles-rank{rank}") for rank in range(world)
    ]

    def forward(signum: int, frame: Any) -> None:  # the ranks decide together; a second signal abandons the step
        for process in ranks:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    said: dict[int, tuple[str, Any]] = {}
    try:
        for process in ranks:
            process.start()
        failed_at = None
        while any(process.is_alive() for process in ranks):
            with contextlib.suppress(queues.Empty):
                rank, kind, what = reports.get(timeout=0.2)
                said[rank] = (kind, what)
            if failed_at is None and any(p.exitcode not in (None, 0) for p in ranks):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 5:  # the others wait on it: stop them
                break
        while True:
            try:
                rank, kind, what = reports.get(timeout=0.5)
                said[rank] = (kind, what)
            except queues.Empty:
                break
    finally:
        for process in ranks:
            if process.is_alive():
                process.terminate()
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    errors = {rank: report for rank, report in said.items() if report[0] != "ok"}
    if errors:  # the rank that failed first-hand, not one that learned it from another
        rank, (kind, message) = min(errors.items(), key=lambda item: ("another rank" in item[1][1], item[0]))
        raised = {"RunSetupError": RunSetupError, "RunInputError": RunInputError, "RunFailed": RunFailed}
        if kind == "KeyboardInterrupt":
            raise KeyboardInterrupt
        if kind in raised:
            raise raised[kind](message)
        raise RunFailed(f"trainer rank {rank} failed: {kind}: {message}")
    silent = [(rank, p.exitcode) for rank, p in enumerate(ranks) if p.exitcode != 0]
    if silent or 0 not in said:
        rank, code = silent[0] if silent else (0, ranks[0].exitcode)
        raise RunFailed(f"trainer rank {rank} died (exit code {code}: killed, or out of memory?)")
    result = said[0][1]
    return RunResult(
        run_dir=Path(result["run_dir"]),
        steps_done=result["steps_done"],
        num_steps=result["num_steps"],
        checkpoint=Path(result["checkpoint"]) if result["checkpoint"] else None,
        stopped_by=result["stopped_by"],
    )


def _stop_with(supervisor: int) -> None:
    """Ask the kernel for a SIGTERM when the supervising process dies (Linux ``prctl(PR_SET_PDEATHSIG)``), and send
    it now if it already has: a ``miles train`` killed by SIGKILL must not leave ranks waiting 30 minutes on each
    other. All ranks get it together, so they stop after the same step and rank 0 saves, as after a Ctrl-C.
    Elsewhere (macOS) nothing is asked."""
    import ctypes
    import os
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def _rank_process(
    rank: int,
    world: int,
    address: str,
    device_type: str,
    config: dict[str, Any],
    run_dir: str,
    resume_from: str | None,
    replace_existing: bool,
    reports: Any,
    supervisor: int,
) -> None:
    """One rank of ``_run_ranks``: joins the process group, trains (``_train``) and reports ("ok", the result) or
    (the exception's type name, its message) on ``reports``; exit status 1 after a failure. If the supervising
    process (pid ``supervisor``) dies, even by SIGKILL, the rank gets a SIGTERM (``_stop_with``)."""
    import datetime
    import sys

    from torch.distributed.device_mesh import init_device_mesh

    _stop_with(supervisor)

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # the console shows INFO; per-step DEBUG lines go to train.log
        handler.setLevel(logging.INFO)
    logging.getLogger("miles").setLevel(logging.INFO if rank == 0 else logging.ERROR)  # rank 0 speaks for all
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    try:
        torch.distributed.init_process_group(
            backend, init_method=address, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
        )
        mesh = init_device_mesh(device_type, (world,))
        result = _train(
            DiffusionConfig.model_validate(config), Path(run_dir),
            resume_from=Path(resume_from) if resume_from else None, replace_existing=replace_existing, mesh=mesh,
        )  # fmt: skip
    except BaseException as err:  # reported to the supervisor, which raises it as one process would
        reports.put((rank, type(err).__name__, " ".join(str(err).split())))
        reports.close()
        reports.join_thread()
        sys.exit(1)
    if rank == 0:
        fields = dataclasses.asdict(result)
        reports.put((rank, "ok", {k: str(v) if isinstance(v, Path) else v for k, v in fields.items()}))
    else:
        reports.put((rank, "ok", None))
    reports.close()
    reports.join_thread()
    torch.distributed.destroy_process_group()
