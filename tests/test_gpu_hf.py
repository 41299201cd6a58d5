"""cudaflash.integrations.transformers on the GPU with cudaflash's kernels: tiny Llama,
Mistral, Qwen2, Gemma 2 and Gemma 3 models (tests/_hf_models.py) against transformers' own
implementations. The references: eager in float32 (the truth) and eager in bf16 (the
same-precision baseline of FlashAttention's accuracy rule; eager has every feature, Gemma 2's
softcapping included, which SDPA ignores); generate() is compared with SDPA's tokens (eager's
for Gemma 2).

Needs a GPU and transformers; each skips with its reason where it is missing.
"""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (an optional "
                                           "dependency; these tests need it)")

import _hf_models as hf  # noqa: E402

from cudaflash import api  # noqa: E402
from cudaflash.integrations import transformers as integration  # noqa: E402

pytestmark = pytest.mark.requires_gpu
NAME = integration.register()
DEVICE = "cuda"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Which cudaflash entry each attention call took (the real kernels run)."""
    calls = []
    dense, varlen = api.flash_attn_func, api.flash_attn_varlen_func

    def counted_dense(*args, **kwargs):
        calls.append("dense")
        return dense(*args, **kwargs)

    def counted_varlen(*args, **kwargs):
        calls.append("varlen")
        return varlen(*args, **kwargs)

    monkeypatch.setattr(api, "flash_attn_func", counted_dense)
    monkeypatch.setattr(api, "flash_attn_varlen_func", counted_varlen)
    return calls


def reference_logits(family, ids, mask):
    return (hf.logits(hf.model(family, "eager", torch.bfloat16, DEVICE), ids, mask),
            hf.logits(hf.model(family, "eager", torch.float32, DEVICE), ids, mask))


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_logits(family, padding, kernel_calls):
    ids, mask = hf.batch(padding, DEVICE)
    ours = hf.logits(hf.model(family, NAME, torch.bfloat16, DEVICE), ids, mask)
    lowp, ref32 = reference_logits(family, ids, mask)
    real = mask.bool()
    hf.check_within(f"{family}, {padding} padding", ours[real], lowp[real], ref32[real])
    assert kernel_calls == ["dense" if padding == "none" else "varlen"] * 2, kernel_calls


def test_logits_head_dim_128(kernel_calls):
    """Two heads of 128 (one K/V head): the other head dim the kernels are built for."""
    import transformers

    config = hf.config("llama")
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 128
    ids, mask = hf.batch("left", DEVICE)
    outs = []
    for impl, dtype in ((NAME, torch.bfloat16), ("eager", torch.bfloat16),
                        ("eager", torch.float32)):
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
        outs.append(hf.logits(m.to(DEVICE, dtype).eval(), ids, mask))
    real = mask.bool()
    hf.check_within("llama d128", *(o[real] for o in outs))
    assert kernel_calls == ["varlen"] * 2


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_greedy_generate_matches_sdpa(family, kernel_calls):
    """Left-padded prompts, 8 greedy tokens: the prefill and the decoding steps (q_len 1
    against the DynamicCache) through cudaflash."""
    ids, mask = hf.batch("left", DEVICE)
    ours = hf.generate(hf.model(family, NAME, torch.bfloat16, DEVICE), ids, mask)
    other = "eager" if family == "gemma2" else "sdpa"  # SDPA has no softcapping
    theirs = hf.generate(hf.model(family, other, torch.bfloat16, DEVICE), ids, mask)
    hf.check_greedy(f"{family} vs {other}", ours, theirs,
                    hf.model(family, "eager", torch.float32, DEVICE), mask, tol=0.5)
    assert len(kernel_calls) == 2 * 8 and kernel_calls[:2] == ["varlen", "varlen"]


def test_greedy_generate_without_padding_decodes_dense(kernel_calls):
    ids, mask = hf.batch("none", DEVICE)
    ours = hf.generate(hf.model("qwen2", NAME, torch.bfloat16, DEVICE), ids, mask)
    theirs = hf.generate(hf.model("qwen2", "sdpa", torch.bfloat16, DEVICE), ids, mask)
    hf.check_greedy("qwen2 unpadded", ours, theirs,
                    hf.model("qwen2", "eager", torch.float32, DEVICE), mask, tol=0.5)
    assert kernel_calls == ["dense"] * (2 * 8)


def test_greedy_generate_with_a_static_cache(kernel_calls):
    """A static cache's empty slots are packed away. generate() would compile the decoding
    step with fullgraph=True on CUDA, which the packed path's graph break forbids (README,
    "Hugging Face transformers"): disable_compile=True."""
    ids, mask = hf.batch("left", DEVICE)
    kwargs = dict(cache_implementation="static", disable_compile=True)
    ours = hf.generate(hf.model("llama", NAME, torch.bfloat16, DEVICE), ids, mask, **kwargs)
    theirs = hf.generate(hf.model("llama", "sdpa", torch.bfloat16, DEVICE), ids, mask,
                         **kwargs)
    hf.check_greedy("llama static cache", ours, theirs,
                    hf.model("llama", "eager", torch.float32, DEVICE), mask, tol=0.5)
    assert set(kernel_calls) == {"varlen"}


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_training_step_gradients(family, padding, kernel_calls):
    ids, mask = hf.batch(padding, DEVICE)
    runs = [hf.loss_and_grads(hf.model(family, impl, dtype, DEVICE).train(), ids, mask)
            for impl, dtype in ((NAME, torch.bfloat16), ("eager", torch.bfloat16),
                                ("eager", torch.float32))]
    (loss, ours), (loss_lowp, lowp), (loss32, ref32) = runs
    assert abs(loss.item() - loss32.item()) <= 2 * abs(loss_lowp.item() - loss32.item()) + 1e-2, \
        (loss.item(), loss_lowp.item(), loss32.item())
    hf.check_grads(ours, lowp, ref32, rtol=2e-3)
    assert set(kernel_calls) == {"dense" if padding == "none" else "varlen"}


@pytest.mark.parametrize("padding", ["none", "left"])
def test_training_step_with_attention_dropout(padding, kernel_calls):
    """attention_dropout > 0 in training mode runs cudaflash's dropout: one torch.manual_seed
    reproduces a step (the loss bitwise; gradients up to the last bits of the model's other
    kernels), another seed gives another loss, gradients are finite."""
    ids, mask = hf.batch(padding, DEVICE)
    m = hf.model("llama", NAME, torch.bfloat16, DEVICE)
    m.config.attention_dropout = 0.2
    for layer in m.model.layers:
        layer.self_attn.attention_dropout = 0.2
    m.train()

    def step(seed):
        torch.manual_seed(seed)
        return hf.loss_and_grads(m, ids, mask)

    (loss_a, grads_a), (loss_b, grads_b), (loss_c, _) = step(1), step(1), step(2)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.allclose(grads_a[n], grads_b[n], rtol=1e-3, atol=1e-6) for n in grads_a)
    assert not torch.equal(loss_a, loss_c)
    assert all(torch.isfinite(g).all() for g in grads_a.values())
    assert set(kernel_calls) == {"dense" if padding == "none" else "varlen"}


def test_packed_sequences_fall_back_on_the_gpu(kernel_calls):
    ids, _ = hf.batch("none", DEVICE, batch_size=1)
    positions = torch.cat([torch.arange(15), torch.arange(25)])[None].to(DEVICE)

    def run(impl, dtype):
        with torch.no_grad():
            return hf.model("gemma3", impl, dtype, DEVICE)(
                input_ids=ids, position_ids=positions, use_cache=False).logits.float()

    with pytest.warns(UserWarning, match="packed sequences"):
        ours = run(NAME, torch.bfloat16)
    hf.check_within("packed sequences", ours, run("eager", torch.bfloat16),
                    run("eager", torch.float32))
    assert kernel_calls == []


@pytest.mark.parametrize("padding", ["none", "left"])
def test_torch_compile(padding, kernel_calls):
    """A compiled model (inductor) with an attention_mask: logits and a training step's
    gradients as in eager mode, through cudaflash's kernels (the attention reads the mask
    in a compiler-disabled region: a graph break per layer)."""
    torch._dynamo.reset()
    ids, mask = hf.batch(padding, DEVICE)
    m = hf.model("llama", NAME, torch.bfloat16, DEVICE)
    compiled = torch.compile(m)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    lowp, ref32 = reference_logits("llama", ids, mask)
    real = mask.bool()
    hf.check_within(f"compiled llama, {padding} padding", got[real], lowp[real], ref32[real])
    assert kernel_calls == ["dense" if padding == "none" else "varlen"] * 2

    m.train()
    _, ours = hf.loss_and_grads(m, ids, mask, forward=compiled)
    _, lowp_grads = hf.loss_and_grads(hf.model("llama", "eager", torch.bfloat16,
                                               DEVICE).train(), ids, mask)
    _, ref_grads = hf.loss_and_grads(hf.model("llama", "eager", torch.float32,
                                              DEVICE).train(), ids, mask)
    hf.check_grads(ours, lowp_grads, ref_grads, rtol=2e-3)
