"""The tests' one door to cudaflash's private internals.

Tests reach what is not public only through the names here, so a change of layout inside the
package is an edit of this file, not of every test. Two kinds:

- read access: the plan tables, the rules and functions that unit tests call directly;
- stand-ins (``monkeypatch``-based, undone after the test): ``replace`` swaps one private
  function for a stand-in in every cudaflash module that holds it. The per-call code binds
  torch's private functions and its own helpers at import (one global lookup per call, not
  an attribute chain), so one object can live under a name in several modules.
"""

import sys

from cudaflash import (_autograd, _call, _checks, _padding, _plans, _torch, api, backward,
                       dispatch, heuristics, launch)

# ---- read access ---------------------------------------------------------------------------

clear_caches = api.clear_caches
plans = _plans.plans  # flash_attn_func's (windowed and capped calls: keys (key, window, cap))
varlen_plans = _plans.varlen_plans
kvcache_plans = _plans.kvcache_plans
plan_key = _plans.plan_key
varlen_plan_key = _plans.varlen_plan_key
fast_allocator = _plans.fast_allocator
checked_forward = _call.checked_forward  # (config, q, k, v, out, softmax_scale, causal, ...)
run = launch.run  # a padded batch past the checks: (config, index, q, k, v, out, scale, ...)
COMBINE_ROWS, COMBINE_THREADS = launch._COMBINE_ROWS, launch._COMBINE_THREADS
entry_role = launch._role  # (kind, mods, cache) -> the role (config.KernelConfig.ROLES) it launches
selected_config = dispatch.selected_config
Rules = dispatch.Rules
select_for_call = dispatch._select  # (device kernels, rules, dtype, d_head, causal, q, k, maps)
split_count = heuristics.split_count
max_splits = heuristics.max_splits
effective_scheme = heuristics.effective_scheme
kernel_window = heuristics.kernel_window
kernel_problem = heuristics.kernel_problem
internal_overlap = _checks.internal_overlap
check_window = _checks.check_window  # window_size -> (left, right) ints, or ValueError
with_unit_last_stride = _checks.with_unit_last_stride  # q, k, v copied where stride(-1) != 1
padded_head_dim = _padding.padded_head_dim
FlashAttnFunction = _autograd.FlashAttnFunction
find_backward_entry = dispatch.find_backward_entry


# ---- stand-ins -----------------------------------------------------------------------------


def _cudaflash_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "cudaflash" or name.startswith("cudaflash."))]


def replace(monkeypatch, original, stand_in) -> None:
    """Every cudaflash module's binding of the function ``original`` -> ``stand_in``."""
    found = False
    for module in _cudaflash_modules():
        for attr, value in list(vars(module).items()):
            if value is original:
                monkeypatch.setattr(module, attr, stand_in)
                found = True
    if not found:
        raise AssertionError(f"no cudaflash module holds {original!r}")


def _replace_torch_binding(monkeypatch, name: str, stand_in) -> None:
    """_torch.``name`` and every module's binding of it (as ``name`` or ``_name``), by name
    as well as identity: in CPU-only torch builds some of these are None."""
    original = getattr(_torch, name)
    for module in _cudaflash_modules():
        for attr in (name, "_" + name):
            if attr in vars(module) and vars(module)[attr] is original:
                monkeypatch.setattr(module, attr, stand_in)


def fake_stream(monkeypatch, handle: int) -> None:
    """torch's current raw stream reads ``handle`` for every device."""
    _replace_torch_binding(monkeypatch, "current_stream", lambda index: handle)


def fake_current_device(monkeypatch, index: int) -> None:
    """torch's current CUDA device reads ``index``."""
    _replace_torch_binding(monkeypatch, "current_device", lambda: index)


def fake_empty_strided_cuda(monkeypatch, empty_strided) -> None:
    """Plans allocate through ``empty_strided`` (None: as if torch lacked the function)."""
    _replace_torch_binding(monkeypatch, "empty_strided_cuda", empty_strided)


def replace_checked_forward(monkeypatch, stand_in) -> None:
    """flash_attn_func's checked forward (what runs when no plan serves a call)."""
    replace(monkeypatch, _call.checked_forward, stand_in)


def replace_run(monkeypatch, stand_in) -> None:
    """The padded batch's launch path past the checks (flash_attn_with_kvcache's too)."""
    replace(monkeypatch, launch.run, stand_in)


def replace_run_varlen(monkeypatch, stand_in) -> None:
    replace(monkeypatch, launch.run_varlen, stand_in)


def replace_auto_kernel(monkeypatch, stand_in) -> None:
    """The forward's kernel selection (and load) by the rules."""
    replace(monkeypatch, dispatch.auto_kernel, stand_in)


def replace_select(monkeypatch, stand_in) -> None:
    """selection.select as the runtime calls it."""
    from cudaflash import selection
    monkeypatch.setattr(selection, "select", stand_in)


def replace_autograd_apply(monkeypatch, stand_in) -> None:
    """flash_attn_func's autograd function's apply."""
    monkeypatch.setattr(_autograd.FlashAttnFunction, "apply", stand_in)


def force_atomic_kernels(monkeypatch) -> None:
    """Small calls run the deterministic backward kernels in either scheme
    (heuristics.effective_scheme); this makes every shape take the atomic ones."""
    monkeypatch.setattr(heuristics, "ATOMIC_MIN_ROWS_PER_CTA", 0)
    monkeypatch.setattr(heuristics, "ATOMIC_MIN_ROWS_PER_CTA_WGMMA", 0)
    fresh_backward_plans(monkeypatch)


def fresh_backward_plans(monkeypatch) -> None:
    """The backward's plans (backward._plans) start empty for this test and those it makes
    go with it: a plan keeps the heuristics' verdict and the tensor maps' layout of its first
    call, which tests that monkeypatch either must not inherit or leave behind."""
    monkeypatch.setattr(backward, "_plans", {})


def force_backward_module(monkeypatch, entry) -> None:
    """Every backward call runs the module ``entry`` (its caches cleared first; call
    clear_backward_cache again after the monkeypatch context ends). A module that serves only
    plain calls (BackwardConfig.plain_calls_only) is not given to the lookups of other calls
    (find_backward_entry's ``plain`` false: the fallback after a refused tensor map), which
    then find the module the manifest gives them. A dropout call's lookup for a fused kernel
    with dropout finds none unless ``entry`` has one (BackwardConfig.fused_dropout), so such
    calls run ``entry``'s deterministic kernels."""
    clear_backward_cache()
    find = dispatch.find_backward_entry

    def forced(index, dtype, d_head, scheme, plain=False, dropout=False):
        if entry.config.plain_calls_only and not plain:
            return find(index, dtype, d_head, scheme, plain, dropout)
        if dropout and not entry.config.fused_dropout:
            return None
        return entry

    replace(monkeypatch, dispatch.find_backward_entry, forced)


clear_backward_cache = dispatch.clear_backward_cache


def replace_ring_step(monkeypatch, stand_in) -> None:
    """What each ring step computes (cudaflash.distributed.layout.ring_step), as the ring's
    loops call it."""
    from cudaflash.distributed import layout

    replace(monkeypatch, layout.ring_step, stand_in)


def usable_backward_entries(index: int) -> list:
    """Every shipped backward module that runs on cuda:``index``, in manifest order."""
    from cudaflash import _driver, manifest

    device = _driver.device(index)
    return list(manifest.load_manifest().usable_backward(device.arch,
                                                         device.smem_optin).values())
