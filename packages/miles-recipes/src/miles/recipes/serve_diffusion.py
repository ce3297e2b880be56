"""``miles serve-diffusion``: a flow model behind SGLang-Diffusion's post-training HTTP API (``miles.diffusion.serve``).

    miles serve-diffusion --model NAME_OR_DIR [--host 127.0.0.1] [--port 30000] [--shift 3.0] [--seed 0]
        [--log-level info]

``--model`` takes what a diffusion recipe's ``model.path`` takes (``miles.recipes.diffusion.build_flow_model``):
tiny-flow, tiny-sd3, tiny-qwen-image, a flow model a run saved, or a local SD3 / Qwen-Image pipeline directory.
It serves on the CPU, float32. A bad flag or model is one ``miles serve-diffusion:`` line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

PROG = "miles serve-diffusion"


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (the flag and the fix), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _fail(f"{message} (see {PROG} --help)")
        sys.exit(2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """``miles serve-diffusion``'s flags (``argv`` None: ``sys.argv``); a bad one exits 2 with one line."""
    parser = _Parser(
        prog=PROG,
        description="Serve a text-to-image flow model behind SGLang-Diffusion's post-training HTTP API "
        "(/rollout/generate, /update_weights_from_disk, /update_weights_from_tensor_checker) with Miles' sampler, "
        "on the CPU: a stand-in for SGLang-Diffusion where it cannot run.",
    )
    parser.add_argument("--model", "--model-path", dest="model", required=True, metavar="NAME_OR_DIR",
                        help="tiny-flow, tiny-sd3, tiny-qwen-image, a flow model a run saved, or a local diffusers "
                        "StableDiffusion3Pipeline / QwenImagePipeline directory")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--shift", type=float, default=3.0,
                        help="the SD3 schedule's shift (Qwen-Image uses its own schedule)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seeds tiny-flow's random weights")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must lie in 1 .. 65535, got {args.port}")
    if not args.shift > 0:
        parser.error(f"--shift must be > 0 (SD3: 3.0), got {args.shift}")
    return args


def _fail(message: str) -> int:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)  # noqa: T201 - CLI output
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGINT / SIGTERM; returns the exit status (2 for a bad flag, a taken port or a bad model)."""
    args = parse_args(argv)
    from miles.rollout.engines.server import port_in_use

    if port_in_use(args.host, args.port):
        return _fail(f"--port {args.port}: something already listens on {args.host}:{args.port}; pick another --port")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from miles.diffusion.serve import serve
    from miles.recipes.diffusion import FlowModelConfig, build_flow_model

    try:
        model = build_flow_model(FlowModelConfig(path=args.model, seed=args.seed), path_key="--model")
    except (ValueError, OSError) as err:  # not a model (ValueError), a file of one missing or unreadable (OSError)
        return _fail(str(err))
    serve(model, model_path=args.model, host=args.host, port=args.port, shift=args.shift, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
