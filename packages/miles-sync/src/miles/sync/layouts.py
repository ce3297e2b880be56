"""Name and layout mapping between Hugging Face checkpoints and the fused layouts of SGLang/vLLM model runners.

HF names keep one tensor per projection; engines fuse them:
    ``{p}.q_proj|k_proj|v_proj.{weight,bias}``  <-> ``{p}.qkv_proj.{weight,bias}``  (concat on dim 0: [q; k; v])
    ``{p}.gate_proj|up_proj.weight``            <-> ``{p}.gate_up_proj.weight``     (concat on dim 0: [gate; up])
    ``{p}.experts.{e}.gate_proj|up_proj.weight`` <-> ``{p}.experts.w13_weight``  [E, 2 * I, H] ([gate_e; up_e])
    ``{p}.experts.{e}.down_proj.weight``         <-> ``{p}.experts.w2_weight``   [E, H, I]
(the ``FusedMoE`` parameter names of SGLang and vLLM). Their HTTP weight-update endpoints take HF names and fuse in
the model's ``load_weights``; these helpers serve an ``apply_fn`` that copies straight into fused parameters, and a
sender that wants one transfer per fused tensor. Both directions stream: a group is emitted once its last member
arrived, and other tensors pass through unchanged.

LoRA adapters have two names each: a model with injected adapters holds ``{m}.lora_A.default.weight`` (``default``
is peft's adapter name), and peft's saved files (``PeftModel.save_pretrained``, what vLLM and SGLang load) say
``base_model.model.{m}.lora_A.weight``; ``to_peft_name`` and ``from_peft_name`` map between them.
"""

import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_DENSE = re.compile(r"^(?P<prefix>.*)\.(?P<proj>q_proj|k_proj|v_proj|gate_proj|up_proj)\.(?P<kind>weight|bias)$")
_FUSED = {"q_proj": ("qkv_proj", 3), "k_proj": ("qkv_proj", 3), "v_proj": ("qkv_proj", 3),
          "gate_proj": ("gate_up_proj", 2), "up_proj": ("gate_up_proj", 2)}  # fmt: skip
_ORDER = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
PEFT_ADAPTER = "default"  # peft's adapter name in an injected model's parameter names
PEFT_PREFIX = "base_model.model."  # peft's saved names: base_model.model.<module>.lora_A.weight


def hf_to_fused(named_tensors: Iterable[tuple[str, Tensor]], *, num_experts: int = 0) -> Iterator[tuple[str, Tensor]]:
    """Fuse HF projections into engine tensors (see the module docstring for names and layouts).

    Args:
        named_tensors: HF ``(name, tensor)`` pairs in any order.
        num_experts: experts per MoE layer (0 for a dense model); needed to know when a stack is complete.

    Raises:
        ValueError: at the end, if a group is incomplete (e.g. a q_proj without its v_proj); the message lists it.
    """
    dense: dict[tuple[str, str, str], dict[str, Tensor]] = {}
    experts: dict[str, dict[tuple[int, str], Tensor]] = {}
    for name, tensor in named_tensors:
        if (match := _EXPERT.match(name)) and num_experts > 0:
            group = experts.setdefault(match["prefix"], {})
            group[int(match["expert"]), match["proj"]] = tensor
            if len(group) == 3 * num_experts:
                del experts[match["prefix"]]
                w13 = [torch.cat([group[e, "gate_proj"], group[e, "up_proj"]]) for e in range(num_experts)]
                yield f"{match['prefix']}.w13_weight", torch.stack(w13)  # [E, 2I, H]
                yield f"{match['prefix']}.w2_weight", torch.stack([group[e, "down_proj"] for e in range(num_experts)])
        elif match := _DENSE.match(name):
            fused, size = _FUSED[match["proj"]]
            key = (match["prefix"], fused, match["kind"])
            group = dense.setdefault(key, {})
            group[match["proj"]] = tensor
            if len(group) == size:
                del dense[key]
                ordered = [group[proj] for proj in _ORDER if proj in group]
                yield f"{match['prefix']}.{fused}.{match['kind']}", torch.cat(ordered)
        else:
            yield name, tensor
    missing = [f"{p}.{f}.{k} has only {sorted(g)}" for (p, f, k), g in dense.items()]
    missing += [f"{p} has {len(g)} of {3 * num_experts} expert projections" for p, g in experts.items()]
    if missing:
        raise ValueError("incomplete fused groups at the end of the update: " + "; ".join(missing))


def fused_to_hf(
    named_tensors: Iterable[tuple[str, Tensor]], *, q_size: int, kv_size: int
) -> Iterator[tuple[str, Tensor]]:
    """Split engine tensors back into HF projections (views, no copy).

    Args:
        named_tensors: engine ``(name, tensor)`` pairs.
        q_size: rows of q_proj (num_heads * head_dim); kv_size: rows of k_proj and of v_proj
            (num_kv_heads * head_dim). gate_up_proj splits in half; w13_weight [E, 2I, H] halves on dim 1.
    """
    for name, tensor in named_tensors:
        prefix, _, leaf = name.rpartition(".")
        module_prefix, _, module = prefix.rpartition(".")
        if module == "qkv_proj":
            q, k, v = tensor.split([q_size, kv_size, kv_size])
            yield from ((f"{module_prefix}.{proj}.{leaf}", t) for proj, t in zip(_ORDER[:3], (q, k, v), strict=True))
        elif module == "gate_up_proj":
            gate, up = tensor.chunk(2)
            yield f"{module_prefix}.gate_proj.{leaf}", gate
            yield f"{module_prefix}.up_proj.{leaf}", up
        elif leaf == "w13_weight":
            for e, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
        elif leaf == "w2_weight":
            yield from ((f"{prefix}.{e}.down_proj.weight", down) for e, down in enumerate(tensor))
        else:
            yield name, tensor


def to_peft_name(name: str) -> str:
    """An injected model's adapter name as peft saves it: ``{m}.lora_A.default.weight`` ->
    ``base_model.model.{m}.lora_A.weight`` (so ``PeftModel.from_pretrained`` and the engines load it)."""
    return PEFT_PREFIX + name.replace(f".{PEFT_ADAPTER}.", ".")


def from_peft_name(name: str) -> str:
    """``to_peft_name``'s inverse: ``base_model.model.{m}.lora_A.weight`` -> ``{m}.lora_A.default.weight`` (a name
    without the ``base_model.model.`` prefix is taken as well).

    Raises: ValueError for a name with no ``.lora_`` part (no LoRA tensor).
    """
    module, dot, rest = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
    if not dot:
        raise ValueError(f"{name!r} is no LoRA adapter name (<module>.lora_A.weight or <module>.lora_B.weight)")
    kind, _, param = rest.partition(".")
    return f"{module}.lora_{kind}.{PEFT_ADAPTER}.{param}"
