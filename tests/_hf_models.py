"""Tiny randomly initialised transformers models and the comparisons the transformers
integration's tests make (CPU tests with reference kernels, GPU tests with cudaflash's).

Five families: Llama (plain causal, GQA), Mistral (one sliding window for every layer),
Qwen2 (a full layer, then a sliding one), Gemma 2 (sliding and full layers, logit
softcapping, query_pre_attn_scalar scaling) and Gemma 3 (sliding and full layers, q/k norms,
query_pre_attn_scalar). Two layers, hidden 256, four heads of 64 sharing two K/V heads,
a 128-token vocabulary. initializer_range 0.1 makes attention sharp enough that a wrong mask
moves the logits far beyond bf16 noise (tests/test_hf_integration.py proves it on a
deliberately wrong window and on ignored padding). Sequences of 40 tokens exceed the window
of 16.
"""

from __future__ import annotations

import torch

WINDOW = 16
SEQLEN = 40
VOCAB = 128
FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "gemma3")
# Where each batch row's real tokens are: (first, end) of SEQLEN positions.
PADDINGS = {
    "none": ((0, SEQLEN), (0, SEQLEN), (0, SEQLEN)),
    "left": ((0, SEQLEN), (7, SEQLEN), (23, SEQLEN)),
    "right": ((0, SEQLEN), (0, SEQLEN - 9), (0, SEQLEN - 21)),
}


def config(family: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, initializer_range=0.1, max_position_embeddings=256,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1, **common)
    if family == "gemma2":
        return transformers.Gemma2Config(
            sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"],
            **common)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            sliding_window=WINDOW, query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention"], **common)
    raise ValueError(f"unknown family {family!r}")


def model(family: str, implementation: str, dtype, device="cpu"):
    """The family's tiny model with ``implementation``'s attention: the same weights for
    every implementation and dtype (one seed, initialised in float32, then cast)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config(family), attn_implementation=implementation)
    return m.to(device=device, dtype=dtype).eval()


def batch(padding: str, device="cpu", batch_size: int = 3):
    """(input_ids, attention_mask) of ``batch_size`` rows of SEQLEN tokens, padded as
    PADDINGS[padding] says (pad token 0; real tokens drawn from 3..VOCAB-1)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (batch_size, SEQLEN), generator=g)
    mask = torch.zeros(batch_size, SEQLEN, dtype=torch.long)
    for row, (first, end) in enumerate(PADDINGS[padding][:batch_size]):
        mask[row, first:end] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device)


def logits(m, ids, mask):
    with torch.no_grad():
        return m(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()


def check_within(what: str, ours, lowp, ref32, atol: float = 1e-2, factor: float = 2.0):
    """FlashAttention's rule: max|ours - ref32| <= factor * max|lowp - ref32| + atol, where
    lowp is the reference implementation in the same low precision as ours."""
    err = (ours - ref32).abs().max().item()
    base = (lowp - ref32).abs().max().item()
    assert err <= factor * base + atol, (
        f"{what}: max |ours - fp32 reference| = {err:.4g} exceeds {factor} x the "
        f"low-precision reference's {base:.4g} + {atol} (fp32 values up to "
        f"{ref32.abs().max().item():.3g})")


def loss_and_grads(m, ids, mask, forward=None):
    """A training step's loss (labels = inputs, padding ignored) and every parameter's
    gradient, float32, by name. A row's first real token is no label either: with left
    padding it would be predicted from a padding position, whose output is arbitrary in every
    implementation (eager: a row with every key masked; cudaflash: zeros). ``forward``: what
    runs the model (default ``m`` itself; e.g. a torch.compile'd ``m``)."""
    m.zero_grad(set_to_none=True)
    first_real = mask.cumsum(1) == 1
    labels = ids.masked_fill((mask == 0) | first_real, -100)
    out = (m if forward is None else forward)(input_ids=ids, attention_mask=mask,
                                              labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()
                                       if p.grad is not None}


def check_grads(ours: dict, lowp: dict, ref32: dict, factor: float = 2.0,
                rtol: float = 1e-3):
    """Per parameter: |ours - ref32| <= factor * |lowp - ref32| + rtol * |ref32| in L2 norm
    (norms, not maxima: a gradient's largest entry is noisier than its direction)."""
    assert set(ours) == set(ref32), f"gradients for {set(ref32) ^ set(ours)} differ in presence"
    for name, g32 in ref32.items():
        err = (ours[name] - g32).norm().item()
        base = (lowp[name] - g32).norm().item()
        assert err <= factor * base + rtol * g32.norm().item(), (
            f"{name}: |grad - fp32 grad| = {err:.4g} exceeds {factor} x the low-precision "
            f"reference's {base:.4g} + {rtol} x |fp32 grad| {g32.norm().item():.4g}")


def generate(m, ids, mask, new_tokens: int = 8, **kwargs):
    with torch.no_grad():
        return m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, **kwargs)


def greedy_gaps(seqs, ref_model, mask):
    """(batch, new) how far below the fp32 reference's argmax each new token of ``seqs``
    (prompt + greedy tokens) scores, given the sequence's own prefix (teacher-forced in one
    forward without a cache); and the reference's logits of each step (batch, new, vocab)."""
    prompt = mask.shape[1]
    new = seqs.shape[1] - prompt
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], new)], dim=1)
    with torch.no_grad():
        ref = ref_model(input_ids=seqs, attention_mask=full_mask, use_cache=False).logits.float()
    step_logits = ref[:, prompt - 1:-1]  # the logits that chose each new token
    chosen = step_logits.gather(-1, seqs[:, prompt:, None])[..., 0]
    return step_logits.max(-1).values - chosen, step_logits


def check_greedy(what: str, ours, theirs, ref_model, mask, tol: float):
    """Greedy sequences (prompt + new tokens) of ours and of the same-precision reference
    implementation (``theirs``). Each of our new tokens must be the fp32 reference's argmax
    given our own prefix, up to a near-tie: ``tol``, or twice the worst gap of theirs (bf16
    itself picks tokens that far below the argmax where logits are large). A wrong decoding
    step picks tokens far below. And ours must equal theirs up to the first step where the
    fp32 reference scores the two tokens within that tolerance (after a near-tie the
    sequences may part for good)."""
    prompt = mask.shape[1]
    gaps, step_logits = greedy_gaps(ours, ref_model, mask)
    tol = max(tol, 2 * greedy_gaps(theirs, ref_model, mask)[0].max().item())
    gap = gaps.max().item()
    assert gap <= tol, (f"{what}: a generated token scores {gap:.3g} below the fp32 reference's "
                        f"argmax given the same prefix (tolerance {tol:.3g}): the decoding "
                        "steps computed wrong logits")
    for row in range(ours.shape[0]):
        for t in range(ours.shape[1] - prompt):
            a, b = ours[row, prompt + t].item(), theirs[row, prompt + t].item()
            if a != b:
                margin = abs(step_logits[row, t, a] - step_logits[row, t, b]).item()
                assert margin <= tol, (
                    f"{what}: row {row} step {t}: token {a} vs the other implementation's {b}, "
                    f"which the fp32 reference scores {margin:.3g} apart (not a near-tie, "
                    f"tolerance {tol:.3g})")
                break
