"""cudaflash.integrations.transformers on the CPU: registration, the mask function's
decisions, and whole tiny models (tests/_hf_models.py) run through the integration with
reference kernels standing in for cudaflash's (tests/_flash_reference.py: flash-attn's
semantics in float32 torch). What this proves is the code around the kernels: which
tokens reach them, the window, scaling and cap they get, the cache path of generate(), the
fallback. The same models on the GPU with the real kernels: tests/test_gpu_hf.py.

Needs transformers (not a dependency of cudaflash, not installed by CI): skipped without it.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (an optional dependency; the "
                           "integration's CPU tests need it)")

import _flash_reference as reference  # noqa: E402
import _hf_models as hf  # noqa: E402
from transformers import masking_utils  # noqa: E402

from cudaflash import api  # noqa: E402
from cudaflash.integrations import transformers as integration  # noqa: E402

NAME = integration.register()


@pytest.fixture
def kernel_calls(monkeypatch):
    """cudaflash's two kernel entries -> the reference, recording which one each call took."""
    calls = []

    def dense(*args, **kwargs):
        calls.append("dense")
        return reference.attention(*args, **kwargs)

    def varlen(*args, **kwargs):
        calls.append("varlen")
        return reference.varlen_attention(*args, **kwargs)

    monkeypatch.setattr(api, "flash_attn_func", dense)
    monkeypatch.setattr(api, "flash_attn_varlen_func", varlen)
    return calls


# ---- registration ----------------------------------------------------------------------------


def test_register_returns_a_name_transformers_hands_over_as_it_is():
    assert integration.register() == NAME == "cuda_fa"
    assert transformers.AttentionInterface._global_mapping[NAME] is integration.attention_forward
    assert masking_utils.AttentionMaskInterface._global_mapping[NAME] is \
        integration.mask_interface
    generic = pytest.importorskip("transformers.utils.generic")
    if hasattr(generic, "is_flash_attention_requested"):  # transformers 5.x
        assert not generic.is_flash_attention_requested(requested_attention_implementation=NAME)
    m = hf.model("llama", NAME, torch.bfloat16)
    assert m.config._attn_implementation == NAME


@pytest.mark.parametrize("name, part", [("cudaflash", "flash"), ("my_sdpa", "sdpa"),
                                        ("paged|cuda_fa", "paged"), ("org/kernel", "/"),
                                        ("eager2", "eager")])
def test_names_transformers_would_interpret_are_refused(name, part):
    with pytest.raises(ValueError, match=f"contains {part!r}"):
        integration.register(name)


def test_register_under_another_name():
    assert integration.register("cf_attention") == "cf_attention"
    m = hf.model("llama", "cf_attention", torch.bfloat16)
    assert m.config._attn_implementation == "cf_attention"


# ---- the mask function's decisions -----------------------------------------------------------


def mask_for(family, ids, mask, sliding, **kwargs):
    """What transformers' mask builder gives a batch without a cache (its arguments as the
    installed version names them: input_embeds and cache_position before 5.x)."""
    import inspect

    config = hf.config(family)
    config._attn_implementation = NAME
    embeds = torch.zeros(*ids.shape, 256, dtype=torch.bfloat16)
    build = (masking_utils.create_sliding_window_causal_mask if sliding
             else masking_utils.create_causal_mask)
    if "input_embeds" in inspect.signature(build).parameters:
        kwargs.update(input_embeds=embeds, cache_position=torch.arange(ids.shape[1]))
    else:
        kwargs.update(inputs_embeds=embeds)
    return build(config=config, attention_mask=mask, past_key_values=None, **kwargs)


@pytest.mark.parametrize("sliding", [False, True])
def test_mask_without_padding_is_dense(sliding):
    ids, mask = hf.batch("none")
    window = hf.WINDOW if sliding else None
    # No mask: known dense on the host, nothing to read (transformers 5.x's q_offset; with
    # 4.x's cache_position tensor it is read like a mask of ones).
    layout = mask_for("mistral", ids, None, sliding)
    assert (layout.causal, layout.window) == (True, window)
    assert layout.tokens is None or layout.tokens.dense()
    # A mask of ones: dense once read (by the attention, once per forward).
    layout = mask_for("mistral", ids, mask, sliding)
    assert (layout.causal, layout.window) == (True, window) and layout.tokens.dense()


def test_mask_with_padding_lists_the_real_tokens():
    ids, mask = hf.batch("left")
    layout = mask_for("llama", ids, mask, sliding=False)
    assert layout.causal and layout.window is None and not layout.tokens.dense()
    assert torch.equal(layout.tokens.key_valid, mask.bool())
    assert torch.equal(layout.tokens.query_valid, mask.bool())


def test_patterns_beyond_the_kernels_are_materialized():
    ids, _ = hf.batch("none", batch_size=1)
    packed_positions = torch.cat([torch.arange(15), torch.arange(25)])[None]
    for sliding in (False, True):
        got = mask_for("mistral", ids, None, sliding, position_ids=packed_positions)
        assert isinstance(got, integration.MaterializedMask), got
        assert "packed sequences" in got.reason
        assert got.additive.shape == (1, 1, hf.SEQLEN, hf.SEQLEN)
    overlay = mask_for("llama", ids, None, False,
                       or_mask_function=lambda b, h, q, kv: kv <= q + 1)
    assert isinstance(overlay, integration.MaterializedMask)
    assert "mask function" in overlay.reason  # 4.x has no use_vmap to tell an overlay by


def test_chunked_attention_is_not_taken_for_a_sliding_window():
    config = hf.config("llama")
    config.attention_chunk_size = 8
    assert integration._sliding_window_of({"local_size": 8, "config": config}) is None
    config.sliding_window = 8
    assert integration._sliding_window_of({"local_size": 8, "config": config}) is None


# ---- whole models ------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_logits_match_eager(family, padding, kernel_calls):
    ids, mask = hf.batch(padding)
    ours = hf.logits(hf.model(family, NAME, torch.bfloat16), ids, mask)
    lowp = hf.logits(hf.model(family, "eager", torch.bfloat16), ids, mask)
    ref32 = hf.logits(hf.model(family, "eager", torch.float32), ids, mask)
    real = mask.bool()
    hf.check_within(f"{family} {padding} padding", ours[real], lowp[real], ref32[real])
    assert set(kernel_calls) == {"dense" if padding == "none" else "varlen"}
    assert len(kernel_calls) == 2  # one call per layer


@pytest.mark.parametrize("wrong", ["window off by one", "padding ignored"])
def test_the_logits_check_catches_a_wrong_mask(wrong, kernel_calls, monkeypatch):
    """Test the tester: the tiny models' attention is sharp enough that a mask one key too
    wide, or no padding mask, fails check_within by far."""
    if wrong == "window off by one":
        family, padding = "mistral", "none"
        monkeypatch.setattr(integration, "_kernel_window",
                            lambda window, causal: (-1, -1) if window is None else (window, 0))
    else:
        family, padding = "llama", "left"
        real_mask_interface = integration.mask_interface

        def no_padding(**kwargs):
            layout = real_mask_interface(**kwargs)
            return integration.MaskLayout(layout.causal, layout.window, None)

        masking_utils.AttentionMaskInterface.register("cf_no_padding", no_padding)
        transformers.AttentionInterface.register("cf_no_padding", integration.attention_forward)
    ids, mask = hf.batch(padding)
    name = "cf_no_padding" if wrong == "padding ignored" else NAME
    ours = hf.logits(hf.model(family, name, torch.bfloat16), ids, mask)
    lowp = hf.logits(hf.model(family, "eager", torch.bfloat16), ids, mask)
    ref32 = hf.logits(hf.model(family, "eager", torch.float32), ids, mask)
    real = mask.bool()
    with pytest.raises(AssertionError, match="exceeds"):
        hf.check_within(wrong, ours[real], lowp[real], ref32[real], factor=4.0, atol=0.1)


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_greedy_generate_matches_eager(family, kernel_calls):
    ids, mask = hf.batch("left")
    ours = hf.generate(hf.model(family, NAME, torch.bfloat16), ids, mask)
    theirs = hf.generate(hf.model(family, "eager", torch.bfloat16), ids, mask)
    hf.check_greedy(family, ours, theirs, hf.model(family, "eager", torch.float32), mask,
                    tol=0.5)
    # One call per layer and step. The prefill runs packed (the batch is left-padded), and so
    # does every step of a layer whose keys still hold padding (a full-attention layer); a
    # sliding-window cache may keep only the last 15 tokens, all real here: dense then.
    assert len(kernel_calls) == 2 * 8 and kernel_calls[:2] == ["varlen", "varlen"]
    full = [t == "full_attention" for t in getattr(hf.config(family), "layer_types",
                                                   ["full_attention"] * 2)]
    if family == "mistral":
        full = [False, False]
    for step in range(1, 8):
        for layer, is_full in enumerate(full):
            took = kernel_calls[2 * step + layer]
            assert took == "varlen" or not is_full, (step, layer, kernel_calls)


def test_decoding_without_padding_runs_dense(kernel_calls):
    ids, mask = hf.batch("none")
    ours = hf.generate(hf.model("gemma2", NAME, torch.bfloat16), ids, mask)
    theirs = hf.generate(hf.model("gemma2", "eager", torch.bfloat16), ids, mask)
    hf.check_greedy("gemma2", ours, theirs, hf.model("gemma2", "eager", torch.float32), mask,
                    tol=0.5)
    assert set(kernel_calls) == {"dense"}


def test_static_cache_generate(kernel_calls):
    """A static cache hands the layers keys past the last query (empty slots): packed away."""
    ids, mask = hf.batch("left")
    m = hf.model("llama", NAME, torch.bfloat16)
    ours = hf.generate(m, ids, mask, cache_implementation="static")
    theirs = hf.generate(hf.model("llama", "eager", torch.bfloat16), ids, mask,
                         cache_implementation="static")
    hf.check_greedy("llama static cache", ours, theirs,
                    hf.model("llama", "eager", torch.float32), mask, tol=0.5)
    assert set(kernel_calls) == {"varlen"}


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])
def test_training_step_gradients_match_eager(family, padding, kernel_calls):
    ids, mask = hf.batch(padding)
    runs = {}
    for impl, dtype in ((NAME, torch.bfloat16), ("eager", torch.bfloat16),
                        ("eager", torch.float32)):
        m = hf.model(family, impl, dtype).train()
        runs[impl, dtype] = hf.loss_and_grads(m, ids, mask)
    (loss, ours), (_, lowp), (loss32, ref32) = runs.values()
    assert abs(loss.item() - loss32.item()) < 0.05 * abs(loss32.item())
    hf.check_grads(ours, lowp, ref32)


def test_fallback_for_packed_sequences_matches_eager(kernel_calls):
    """position_ids restarting mid-row (a packed batch without a mask): the integration
    warns and runs the materialized mask, never the kernels."""
    ids, _ = hf.batch("none", batch_size=1)
    positions = torch.cat([torch.arange(15), torch.arange(25)])[None]

    def run(impl, dtype):
        with torch.no_grad():
            return hf.model("llama", impl, dtype)(input_ids=ids, position_ids=positions,
                                                   use_cache=False).logits.float()

    with pytest.warns(UserWarning, match="packed sequences"):
        ours = run(NAME, torch.bfloat16)
    hf.check_within("packed", ours, run("eager", torch.bfloat16), run("eager", torch.float32))
    assert kernel_calls == []


def test_fallback_softcap_matches_eager(kernel_calls):
    ids, _ = hf.batch("none", batch_size=1)
    positions = torch.cat([torch.arange(15), torch.arange(25)])[None]

    def run(impl, dtype):
        with torch.no_grad():
            return hf.model("gemma2", impl, dtype)(input_ids=ids, position_ids=positions,
                                                    use_cache=False).logits.float()

    with pytest.warns(UserWarning):
        ours = run(NAME, torch.bfloat16)
    hf.check_within("gemma2 packed", ours, run("eager", torch.bfloat16),
                    run("eager", torch.float32))


@pytest.mark.parametrize("padding", ["none", "left"])
def test_torch_compile_with_a_mask(padding, kernel_calls):
    """Under torch.compile the mask function traces (tensor ops only); the attention reads
    the mask on the host in a compiler-disabled region (a graph break per layer) and runs
    the dense kernel where nothing is padded, the packed one where something is."""
    ids, mask = hf.batch(padding)
    m = hf.model("gemma2", NAME, torch.bfloat16)
    eager = hf.logits(m, ids, mask)
    kernel_calls.clear()
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="eager")
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    assert torch.equal(got, eager)
    assert kernel_calls == ["dense" if padding == "none" else "varlen"] * 2


def test_torch_compile_without_a_mask_is_right_but_materialized(kernel_calls):
    """Without an attention_mask, transformers' traced mask builders add a packed-sequence
    overlay from position_ids (at trace time they cannot see whether positions restart), a
    pattern the kernels cannot express: the compiled model runs the materialized mask,
    fullgraph, with the right result (the README says to pass attention_mask)."""
    ids, mask = hf.batch("none")
    m = hf.model("llama", NAME, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(input_ids=ids, use_cache=False).logits.float()
    assert kernel_calls == []
    hf.check_within("compiled, no mask", got,
                    hf.logits(hf.model("llama", "eager", torch.bfloat16), ids, mask),
                    hf.logits(hf.model("llama", "eager", torch.float32), ids, mask))


# ---- refusals ----------------------------------------------------------------------------------


def test_attention_dropout_in_training_reaches_the_kernels(kernel_calls, monkeypatch):
    """A config's attention_dropout reaches flash_attn_func's dropout_p in training mode (the
    dense and the packed paths), 0.0 in eval mode, and a step's gradients flow."""
    seen = []
    dense, varlen = integration.api.flash_attn_func, integration.api.flash_attn_varlen_func

    def dense_seen(*args, **kwargs):
        seen.append(kwargs.get("dropout_p"))
        return dense(*args, **kwargs)

    def varlen_seen(*args, **kwargs):
        seen.append(kwargs.get("dropout_p"))
        return varlen(*args, **kwargs)

    monkeypatch.setattr(integration.api, "flash_attn_func", dense_seen)
    monkeypatch.setattr(integration.api, "flash_attn_varlen_func", varlen_seen)
    config = hf.config("llama")
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    m = m.to(torch.bfloat16).train()
    for padding in ("none", "left"):
        seen.clear()
        ids, mask = hf.batch(padding)
        m(input_ids=ids, attention_mask=mask).logits.float().sum().backward()
        assert seen and set(seen) == {0.1}, (padding, seen)
        assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
    assert set(kernel_calls) == {"dense", "varlen"}
    seen.clear()
    with torch.no_grad():
        m.eval()(input_ids=ids, attention_mask=mask)
    assert set(seen) == {0.0}


def test_attention_dropout_with_softcap_is_refused(kernel_calls):
    config = hf.config("gemma2")
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    m = m.to(torch.bfloat16).train()
    ids, mask = hf.batch("none")
    with pytest.raises(NotImplementedError, match=r"attention dropout 0\.1 with softcap"):
        m(input_ids=ids, attention_mask=mask)


def test_float32_outside_autocast_is_refused(kernel_calls):
    ids, mask = hf.batch("none")
    with pytest.raises(TypeError, match="load the model with dtype=torch.bfloat16"):
        hf.logits(hf.model("llama", NAME, torch.float32), ids, mask)


def test_float32_under_autocast_runs_in_the_autocast_dtype(kernel_calls, monkeypatch):
    seen = []

    def dense(q, k, v, **kwargs):
        seen.append(q.dtype)
        return reference.attention(q, k, v, **kwargs)

    monkeypatch.setattr(api, "flash_attn_func", dense)
    ids, mask = hf.batch("none")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hf.logits(hf.model("llama", NAME, torch.float32), ids, mask)
    assert seen == [torch.bfloat16, torch.bfloat16]


def test_a_caller_4d_mask_runs_the_fallback(kernel_calls):
    ids, mask = hf.batch("none", batch_size=1)
    allowed = torch.ones(hf.SEQLEN, hf.SEQLEN, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(
        ~allowed, torch.finfo(torch.bfloat16).min)
    m = hf.model("llama", NAME, torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hf.logits(m, ids, additive)
    assert any("4D mask given by the caller" in str(w.message) for w in caught)
    hf.check_within("4D mask", got, hf.logits(hf.model("llama", "eager", torch.bfloat16), ids,
                                               mask),
                    hf.logits(hf.model("llama", "eager", torch.float32), ids, mask))
    assert kernel_calls == []
