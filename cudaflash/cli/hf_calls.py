"""The GPU side of the ``hf`` suite (``suites.HF_*``): one randomly initialised Llama-like
transformers model per variant (the same weights: one seed; built once, on the GPU, and kept
for every row of the run), and the calls that ``timing.time_in_turns`` times, keyed (phase,
variant). transformers is imported here only, when the suite runs; a variant that cannot be
built (flash_attention_2 without the flash-attn package) gets calls that raise why, which the
suite reports as n/a."""

from __future__ import annotations

import contextlib

import torch

from .suites import HF_DECODE_STEPS, HF_MODEL, Options, Row
from .timing import TORCH_DTYPES

NO_CONTEXT = contextlib.nullcontext
SEED = 0
MAX_POSITIONS = 16384  # every row's prompt and decoding steps fit: one model serves them all
_models: dict = {}  # (implementation, dtype, device) -> the model, or why it cannot be built


def _unavailable(why: str):
    def call():
        raise RuntimeError(why)
    return call


def _model(transformers, implementation: str, dtype, device):
    """The suite's model with ``implementation``'s attention, or the reason (a string) it
    cannot be built; initialised on ``device`` (fast), then cast to ``dtype``."""
    key = (implementation, dtype, str(device), tuple(sorted(HF_MODEL.items())))
    if key not in _models:
        m = HF_MODEL
        config = transformers.LlamaConfig(
            vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
            num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
            num_key_value_heads=m["kv_heads"], head_dim=m["d_head"],
            max_position_embeddings=MAX_POSITIONS)
        torch.manual_seed(SEED)
        try:
            with torch.device(device):
                model = transformers.AutoModelForCausalLM.from_config(
                    config, attn_implementation=implementation)
            _models[key] = model.to(dtype=dtype)
        except Exception as e:  # e.g. flash_attention_2 without flash-attn: n/a, with why
            _models[key] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    return _models[key]


def _prefill(model, ids):
    def call():
        model.eval()
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return call


def _decode(model, ids):
    """HF_DECODE_STEPS greedy steps against the prompt's cache, which the first call fills
    (a warm-up call: never timed) and every call crops back to the prompt."""
    state = {}

    def call():
        model.eval()
        with torch.inference_mode():
            if not state:
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                state["cache"] = out.past_key_values
                state["first"] = out.logits[:, -1:].argmax(-1)
            cache, token = state["cache"], state["first"]
            for _ in range(HF_DECODE_STEPS):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            cache.crop(-HF_DECODE_STEPS)  # negative: remove that many (every version)
            return token
    return call


def _train(model, ids):
    def call():
        model.train()
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss
    return call


PHASE_CALLS = {"prefill": _prefill, "decode": _decode, "train": _train}


def hf_calls(opts: Options, row: Row, device) -> dict:
    """(phase, variant) -> (fn, context) on one batch of random token ids."""
    import transformers

    from ..integrations import transformers as integration

    implementations = {"cudaflash": integration.register(), "sdpa": "sdpa",
                       "flash_attention_2": "flash_attention_2"}
    seqlen, dtype = row.get("S"), TORCH_DTYPES[row.get("dtype")]
    if seqlen + HF_DECODE_STEPS > MAX_POSITIONS:
        raise ValueError(f"S={seqlen}: the hf suite's model holds {MAX_POSITIONS} positions")
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, HF_MODEL["vocab"], (row.get("B"), seqlen), generator=g).to(device)
    calls = {}
    for variant in opts.variants:
        model = _model(transformers, implementations[variant], dtype, device)
        for phase in opts.phases:
            calls[phase, variant] = (_unavailable(model) if isinstance(model, str)
                                     else PHASE_CALLS[phase](model, ids)), NO_CONTEXT
    return calls
