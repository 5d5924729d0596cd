"""comet.megatron.CometMoELayer against upstream megatron-core's own MoELayer (alltoall token
dispatcher, SequentialMLP experts, TopKRouter with aux loss) on CPU: same weights (Megatron's
state dict loads unchanged), same input -> same output, input gradient and every parameter
gradient; with token dropping (capacity factor); deferred expert weight gradients (backward_dw);
1 rank and expert parallelism over 2 ranks; expert tensor parallelism (EP 1 x ETP 2 on 2 ranks,
EP 2 x ETP 2 on 4: float64, bf16, capacity, attention TP 2 with and without sequence parallelism;
the group order and buffer checks); shared experts (plain, gated, Megatron's overlap flag),
computed by comet between dispatch and combine; the layer-spec helper in a GPT model.

Upstream's own layer needs a few CPU patches (tests/megatron_cpu_patches.py) to serve as the
reference; comet.megatron needs none: test_comet_layer_runs_without_upstream_patches builds and
runs CometMoELayer on 1 and 2 CPU ranks (and 2 with ETP 2) in processes that never import the
patches, and test_readme_megatron_example_runs_as_written runs README's Megatron code block as written.
Also: the stacked SequentialMLP weights (once per forward; kept between forwards
by default until an in-place update or an optimizer step). Skipped when megatron-core is not installed.

The exact comparisons run both layers in float64, with tolerances derived from the computation (see
"what the same means" below), so that they hold on any CPU; test_comparison_catches_wrong_gradients
shows that they still refuse a slightly scaled, swapped or float32-rounded gradient. bf16 runs
compare to bf16 tolerances."""
import pytest
import torch

pytest.importorskip("megatron.core")

from tests.dist_utils import run_ranks

H, FFN, E, K = 16, 12, 4, 2


def _setup(ep):
    from tests import megatron_cpu_patches

    megatron_cpu_patches.apply()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep,
                                             create_gloo_process_groups=False)


def _config(**over):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
              moe_router_topk=K, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
              gated_linear_unit=True, activation_func=torch.nn.functional.silu,
              add_bias_linear=False, moe_token_dispatcher_type="alltoall",
              use_cpu_initialization=True, bias_activation_fusion=False,
              moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.05,
              gradient_accumulation_fusion=False, params_dtype=torch.float64,
              hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.4,
              expert_model_parallel_size=torch.distributed.get_world_size())
    kw.update(over)
    return TransformerConfig(**kw)


def _layers(cfg, comet_cfg=None, grouped=False, **comet_kw):
    """(upstream, ours) MoE layers of the local spec: SequentialMLP experts, or with grouped=True
    the legacy GroupedMLP (needs tests.megatron_cpu_patches.use_torch_grouped_gemm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import build_module

    from comet.megatron import CometMoELayer, comet_moe_spec

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=grouped,
                                    moe_use_legacy_grouped_gemm=grouped)
    torch.manual_seed(1 + torch.distributed.get_rank())
    upstream = build_module(spec.submodules.mlp, config=cfg)
    comet_spec = comet_moe_spec(spec).submodules.mlp
    comet_spec.params = dict(comet_spec.params, **comet_kw)
    ours = build_module(comet_spec, config=comet_cfg or cfg)
    assert type(upstream) is MoELayer and type(ours) is CometMoELayer
    ours.load_state_dict(upstream.state_dict(), strict=True)  # the same checkpoint format
    return upstream, ours


def _run(layer, x, v):
    """{"out", "dx", "d<parameter name>"}: the layer's output, input gradient and every parameter
    gradient for the loss (out * v).sum()."""
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    (out * v).sum().backward()
    return {"out": out.detach(), "dx": x.grad,
            **{f"d{n}": p.grad for n, p in layer.named_parameters()}}


# -- what "the same" means ------------------------------------------------------------------------
# The exact checks run both layers in float64 (_config's params_dtype, float64 inputs), so that
# what they compare does not depend on the CPU: in float32 the two sides' BLAS kernels round
# differently on different x86-64 CPUs (other vector widths and blockings), by more than a fixed
# tolerance that still means something. Each element must agree to a fraction `tol` of the compared
# tensor's largest element (its scale):
#
# F64_TOL (float64 end to end: the output, the expert and shared-expert weight gradients). Both
#   sides do the same float64 arithmetic, summed in different orders (BLAS on one side, comet's
#   tile GEMM on the other); a sum of n rounded terms in two orders differs by at most
#   2 * gamma_n * (its sum of |terms|), gamma_n = n u / (1 - n u), u = 2^-53. n along the longest
#   chain: H = 16 (fc1) + FFN = 12 (fc2) + K = 2 (the top-k sum) in the forward, as many in the
#   backward, the weight gradients' sums over at most T * K = 36 rows (T = 18 tokens) and 2
#   accumulated backward passes (cache 2): n <= 100, 2 * gamma_100 = 2.2e-14. 1e-12 leaves room
#   for sums of |terms| up to 45 times the tensor's largest element; every comparison of this file
#   differs by at most 7e-16 of it.
# ROUTER_TOL (what passes through Megatron's router backward: dx and the router's weight gradient;
#   everything after an optimizer step or in a GPT model, where a router's input already differs
#   by float64 rounding). Megatron computes the router's softmax or sigmoid in float32 (its code,
#   on both sides): the same input bits give the same float32 values, but two float64 values a
#   rounding apart round to float32 numbers one float32 ulp (2^-23 relative) apart when a float32
#   rounding point lies between them (rare: ~1e-9 per element). So these tensors are float32
#   results: 2^-17 = 64 float32 ulps of the scale, room for one such ulp entering the sums over
#   T = 18 tokens and E = 4 experts that follow (every comparison here: at most 2e-15 of it).
#
# Both are far below what a wrong result changes: test_comparison_catches_wrong_gradients shows that
# a gradient scaled by 1 + 1e-6 (1 + 1e-4 where ROUTER_TOL applies), two experts' gradients swapped,
# or one rounded to float32, fails the check.
F64_TOL = 1e-12
ROUTER_TOL = 2.0 ** -17


def _tolerance(key, router_tol=False):
    """F64_TOL or ROUTER_TOL (see above) for _run's `key`; router_tol: ROUTER_TOL for every key."""
    return ROUTER_TOL if router_tol or key == "dx" or "router" in key else F64_TOL


def _assert_same(tag, got, want, atol=None, rtol=None, router_tol=False):
    """got and want (dicts of tensors, as _run returns) agree: in float64 each element to
    _tolerance(key) of the tensor's scale; otherwise (bf16) to the given atol and rtol."""
    assert got.keys() == want.keys(), (tag, sorted(got), sorted(want))
    for key, w in want.items():
        g = got[key]
        if atol is None:
            assert w.dtype == torch.float64, f"{tag} {key}: the exact checks run in float64"
            scale = float(w.abs().max()) if w.numel() else 0.0
            tol = _tolerance(key, router_tol)
            torch.testing.assert_close(g, w, atol=tol * scale, rtol=0,
                                       msg=lambda m, key=key, tol=tol: f"{tag} {key} (tolerance "
                                                                       f"{tol:.1e} of its scale): {m}")
        else:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol,
                                       msg=lambda m, key=key: f"{tag} {key}: {m}")


def _compare(upstream, ours, x, v, tag, atol=None, rtol=None, deferred=False, router_tol=False):
    want = _run(upstream, x, v)
    got = _run(ours, x, v)
    assert ours.token_dispatcher is None, "Megatron's token dispatcher was built"
    assert want["out"].abs().max() > 0.1, "weights too small for a meaningful comparison"
    if deferred:  # expert weight gradients wait for backward_dw
        assert all(g is None for n, g in got.items() if "experts" in n), tag
        assert got["drouter.weight"] is not None
        ours.backward_dw()
        got.update({f"d{n}": p.grad for n, p in ours.named_parameters()})
    _assert_same(tag, got, want, atol, rtol, router_tol)
    out_c, out_u = got["out"].double(), want["out"].double()
    return float((out_c - out_u).abs().max() / out_u.abs().max())


def _one_rank_checks(rank, world):
    _setup(1)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 3, H, generator=g).double()  # [seq, batch, hidden]
    v = torch.randn(6, 3, H, generator=g).double()
    diffs = {}

    upstream, ours = _layers(_config())
    diffs["dropless"] = _compare(upstream, ours, x, v, "dropless")
    assert ours.comet_fused_activation == "swiglu"  # Megatron's GLU with F.silu: fused

    # plain experts with exact GELU: fused too; a clamped GLU keeps Megatron's own activation
    upstream, ours = _layers(_config(gated_linear_unit=False,
                                     activation_func=torch.nn.functional.gelu))
    diffs["gelu"] = _compare(upstream, ours, x, v, "gelu")
    assert ours.comet_fused_activation == "gelu"
    assert _layers(_config(activation_func_clamp_value=7.0))[1]._fused_activation() is None

    # token dropping: some (token, expert) pairs leave the routing map -> -1 slots in comet
    cfg = _config(moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
    upstream, ours = _layers(cfg)
    with torch.no_grad():
        _, routing_map = ours.route(x)
    assert (routing_map.sum(1) < K).any(), "the capacity case should drop some slots"
    diffs["capacity"] = _compare(upstream, ours, x, v, "capacity")

    # renormalised sigmoid scores with a top-k scaling factor, z-loss
    cfg = _config(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.0,
                  moe_z_loss_coeff=1e-3)
    upstream, ours = _layers(cfg)
    diffs["sigmoid"] = _compare(upstream, ours, x, v, "sigmoid")

    # bf16 parameters and activations, fp32 router (Megatron's moe_router_dtype)
    upstream, ours = _layers(_config(params_dtype=torch.bfloat16, bf16=True,
                                     moe_router_dtype="fp32"))
    # atol 3e-2: dW1 rounds a different product to bf16 on each side (comet w * dout, the
    # operand of its bf16 weight-gradient GEMM; Megatron probs * act), gradients up to ~16
    diffs["bf16"] = _compare(upstream, ours, x.bfloat16(), v.bfloat16(), "bf16", atol=3e-2,
                             rtol=2e-2)

    upstream, ours = _layers(_config(), delay_wgrad=True)
    diffs["deferred"] = _compare(upstream, ours, x, v, "deferred", deferred=True)

    diffs.update(_shared_expert_checks(x, v))
    diffs["cache"] = _stacked_weight_checks(x, v)
    diffs["gpt"] = _gpt_model_check()
    return diffs


def _shared_expert_checks(x, v):
    """Megatron's shared experts (SharedExpertMLP, optionally gated): upstream computes them
    before routing, comet between dispatch and combine; same output and gradients."""
    import comet

    diffs = {}
    cfg = _config(moe_shared_expert_intermediate_size=8)
    upstream, ours = _layers(cfg)
    assert ours.shared_experts is not None
    order = []
    real0, real1, real_shared = comet.moe_layer0, comet.moe_layer1, ours.shared_experts.forward
    comet.moe_layer0 = lambda *a, **k: order.append("layer0") or real0(*a, **k)
    comet.moe_layer1 = lambda *a, **k: order.append("layer1") or real1(*a, **k)
    ours.shared_experts.forward = lambda *a, **k: order.append("shared") or real_shared(*a, **k)
    try:
        diffs["shared"] = _compare(upstream, ours, x, v, "shared")
    finally:
        comet.moe_layer0, comet.moe_layer1 = real0, real1
        del ours.shared_experts.forward
    assert order[:3] == ["layer0", "shared", "layer1"], order  # the forward's order

    cfg = _config(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
    upstream, ours = _layers(cfg)
    assert ours.shared_experts.gate_weight is not None
    diffs["shared_gate"] = _compare(upstream, ours, x, v, "shared_gate")

    # Megatron's overlap flag (its overlap needs a CUDA stream in upstream's dispatcher, so the
    # reference is upstream without the flag; the weights are the same)
    overlap = _config(moe_shared_expert_intermediate_size=8, moe_shared_expert_overlap=True)
    upstream, ours = _layers(_config(moe_shared_expert_intermediate_size=8), comet_cfg=overlap)
    assert ours.shared_expert_overlap
    diffs["shared_overlap"] = _compare(upstream, ours, x, v, "shared_overlap")
    return diffs


def _stacked_weight_checks(x, v):
    """SequentialMLP weights are stacked once per forward (dispatch and combine share it) with
    cache_expert_weights=False; by default once across forwards until the parameters may change:
    an in-place update (an SGD step) or a write through .data followed by an optimizer step (how
    Megatron's optimizers write the model parameters). Output and gradients match upstream before
    and after each (a stale stack would not)."""
    import comet.megatron as cm

    calls = []
    real = cm.expert_weights
    cm.expert_weights = lambda *a: calls.append(1) or real(*a)
    try:
        _, plain = _layers(_config(), cache_expert_weights=False)
        for _ in range(2):
            plain(x)
        assert len(calls) == 2, calls  # one stack per forward, not two
        calls.clear()
        upstream, ours = _layers(_config())  # the default caches
        diff = _compare(upstream, ours, x, v, "cache 1")
        _compare(upstream, ours, x, v, "cache 2")  # the gradients accumulate on both sides
        assert len(calls) == 1, calls  # the second forward reused the stack
        before = ours(x)[0].detach()
        for layer in (upstream, ours):  # a small step; the routers' weights now differ by rounding
            torch.optim.SGD(layer.parameters(), lr=0.02).step()
        _compare(upstream, ours, x, v, "cache after step", router_tol=True)
        assert len(calls) == 2, calls  # the step invalidated it
        assert not torch.allclose(ours(x)[0], before), "the step should change the output"
        # Megatron's way: the model parameters written through .data (no version bump), right
        # after the inner optimizer's step; the step count invalidates the stack
        with torch.no_grad():
            for layer in (upstream, ours):
                for p in layer.experts.parameters():
                    p.data.mul_(1.01)
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0).step()
        for layer in (upstream, ours):  # fresh gradients: accumulated ones only add rounding
            layer.zero_grad(set_to_none=True)
        _compare(upstream, ours, x, v, "cache after a .data write and a step", router_tol=True)
        assert len(calls) == 3, calls
    finally:
        cm.expert_weights = real
    return diff


def _gpt_model_check():
    """A 2-layer GPT model built from comet_moe_spec(spec): every MoE layer is a CometMoELayer,
    and with upstream's weights its logits and gradients match upstream's model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from comet.megatron import CometMoELayer, comet_moe_spec

    cfg = _config()
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    models = []
    for s in (spec, comet_moe_spec(spec)):
        torch.manual_seed(3)
        models.append(GPTModel(config=cfg, transformer_layer_spec=s, vocab_size=32,
                               max_sequence_length=8, position_embedding_type="rope").double())
    upstream, ours = models
    assert sum(type(m) is MoELayer for m in upstream.modules()) == 2
    assert sum(type(m) is CometMoELayer for m in ours.modules()) == 2
    assert not any(type(m) is MoELayer for m in ours.modules())
    ours.load_state_dict(upstream.state_dict(), strict=True)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(5))
    position_ids = torch.arange(8).expand(2, 8)
    mask = torch.tril(torch.ones(1, 1, 8, 8)) < 0.5
    outs = []
    for m in models:
        logits = m(tokens, position_ids, mask)
        assert logits.dtype == torch.float64
        logits.square().mean().backward()
        outs.append({"logits": logits.detach(),
                     **{f"d{n}": p.grad for n, p in m.named_parameters()}})
    # the second layer's router sees the first layer's output, equal up to float64 rounding
    _assert_same("gpt", outs[1], outs[0], router_tol=True)
    return float((outs[1]["logits"] - outs[0]["logits"]).abs().max()
                 / outs[0]["logits"].abs().max())


def test_matches_megatron_moe_layer_one_rank():
    diffs = run_ranks(_one_rank_checks, 1, timeout=150)[0]
    assert set(diffs) == {"dropless", "gelu", "capacity", "sigmoid", "bf16", "deferred", "shared",
                          "shared_gate", "shared_overlap", "cache", "gpt"}
    print(diffs)


def _fc(i, e):
    return f"dexperts.local_experts.{e}.linear_fc{i}.weight"


def _swap(key_a, key_b):
    return lambda r: {key_a: r[key_b], key_b: r[key_a]}


def _scale(key, factor):
    return lambda r: {key: r[key] * factor}


# Wrong results the float64 check must refuse: {what: (router_tol, the changed entries)}.
WRONG = {
    "an expert's weight gradient scaled by 1 + 1e-6": (False, _scale(_fc(2, 1), 1 + 1e-6)),
    "two experts' weight gradients swapped": (False, _swap(_fc(1, 0), _fc(1, 1))),
    "an expert's weight gradient rounded to float32": (
        False, lambda r: {_fc(1, 2): r[_fc(1, 2)].float().double()}),
    "the output scaled by 1 + 1e-6": (False, _scale("out", 1 + 1e-6)),
    "the input gradient scaled by 1 + 1e-4": (False, _scale("dx", 1 + 1e-4)),
    "the router's weight gradient scaled by 1 + 1e-4": (False, _scale("drouter.weight", 1 + 1e-4)),
    "an accumulated gradient scaled by 1 + 1e-4 (ROUTER_TOL)": (True, _scale(_fc(2, 3), 1 + 1e-4)),
}


def _wrong_gradient_checks(rank, world):
    """{what: refused by _assert_same} for each of WRONG applied to comet's results (the real
    results pass first)."""
    _setup(1)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 3, H, generator=g).double()
    v = torch.randn(6, 3, H, generator=g).double()
    upstream, ours = _layers(_config())
    for layer in (upstream, ours):  # as in "cache 2": the gradients accumulate over two backwards
        _run(layer, x, v)
    want, got = _run(upstream, x, v), _run(ours, x, v)
    _assert_same("real", got, want)
    refused = {}
    for what, (router_tol, change) in WRONG.items():
        try:
            _assert_same(what, {**got, **change(got)}, want, router_tol=router_tol)
            refused[what] = False
        except AssertionError:
            refused[what] = True
    return refused


def test_comparison_catches_wrong_gradients():
    """The check the comparisons above make (_assert_same, float64) refuses a gradient that is
    slightly wrong (scaled by 1 + 1e-6, or 1 + 1e-4 where ROUTER_TOL applies), two experts'
    gradients swapped, or a gradient computed to float32 precision only, while the two layers' real
    results (gradients accumulated over two backward passes) pass it."""
    refused = run_ranks(_wrong_gradient_checks, 1, timeout=150)[0]
    assert refused == {what: True for what in WRONG}, refused


def _two_rank_checks(rank, world):
    _setup(world)
    g = torch.Generator().manual_seed(11 + rank)  # each rank its own tokens
    x = torch.randn(5 + 2 * rank, 2, H, generator=g).double()
    v = torch.randn(5 + 2 * rank, 2, H, generator=g).double()
    upstream, ours = _layers(_config())
    assert ours.num_local_experts == E // world
    diffs = [_compare(upstream, ours, x, v, f"ep2 rank {rank}")]
    upstream, ours = _layers(_config(moe_shared_expert_intermediate_size=8,
                                     moe_shared_expert_gate=True))
    diffs.append(_compare(upstream, ours, x, v, f"ep2 shared rank {rank}"))
    return diffs


def test_matches_megatron_expert_parallel_two_ranks():
    run_ranks(_two_rank_checks, 2, timeout=150)


def test_comet_moe_spec_replaces_only_moe_layers():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from comet.megatron import CometMoELayer, comet_moe_spec

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    swapped = comet_moe_spec(spec)
    assert spec.submodules.mlp.module is MoELayer  # the original is untouched
    assert swapped.submodules.mlp.module is CometMoELayer
    assert swapped.submodules.self_attention.module is spec.submodules.self_attention.module
    dense = get_gpt_layer_local_spec()
    assert comet_moe_spec(dense).submodules.mlp.module is dense.submodules.mlp.module


def test_routing_to_topk():
    from comet.megatron import routing_to_topk

    probs = torch.tensor([[0.0, 0.6, 0.0, 0.4], [0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
                         requires_grad=True)
    ids, w = routing_to_topk(probs, probs.detach() > 0, 2)
    assert ids.tolist() == [[1, 3], [0, -1], [-1, -1]]
    p = probs.detach()
    assert torch.equal(w, torch.stack([torch.stack([p[0, 1], p[0, 3]]), torch.stack([p[1, 0], p[2, 0]]),
                                       torch.zeros(2)]))
    w.sum().backward()
    assert probs.grad.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]]


def test_grouped_mlp_weights_are_read_in_place():
    """GroupedMLP stores weight1 [H, E_local*N0] and weight2 [E_local*N1, H]: expert_weights
    hands them to the ops as transposed-layout views (no copy), with the same results as the
    per-expert matrices SequentialMLP would give."""
    import types

    import comet
    from comet.megatron import expert_weights

    el, n0, n1 = 3, 2 * FFN, FFN
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(el, n0, H, generator=g)  # per expert, as linear_fc1.weight
    w1 = torch.randn(el, H, n1, generator=g)  # as linear_fc2.weight
    grouped = types.SimpleNamespace(
        weight1=w0.transpose(1, 2).contiguous().view(H, el * n0),  # Megatron's flat storage
        weight2=w1.transpose(1, 2).contiguous().view(el * n1, H))
    v0, v1, transposed = expert_weights(grouped, el, H)
    assert transposed and v0.data_ptr() == grouped.weight1.data_ptr()
    assert v1.data_ptr() == grouped.weight2.data_ptr()
    assert torch.equal(v0.transpose(1, 2), w0) and torch.equal(v1.transpose(1, 2), w1)
    x = torch.randn(7, H, generator=g)
    ids = torch.randint(0, el, (7, K), generator=g)
    wts = torch.rand(7, K, generator=g)
    buf = comet.Buffer.simulated_world(1)[0]
    outs = []
    for a, b, t in ((w0, w1, False), (v0, v1, True)):
        y0, lay = comet.moe_layer0(x, a, ids, num_experts=el, w0_transposed=t, buffer=buf)
        outs.append(comet.moe_layer1(torch.tanh(y0[:, :n1]).contiguous(), b, wts, lay,
                                     w1_transposed=t, buffer=buf))
    assert torch.equal(outs[0], outs[1])


def _capacity_bound_checks(rank, world):
    """moe_expert_capacity_factor bounds the rows: layer0 gets max_rows (and returns that many
    rows), and the layer equals upstream's and, bitwise, itself on the dynamic path."""
    from comet import nn as comet_nn
    from megatron.core.transformer.moe.moe_utils import get_capacity

    from tests.layer0_spy import spy_layer0

    _setup(world)
    g = torch.Generator().manual_seed(21 + rank)  # each rank its own tokens, as many
    x = torch.randn(5, 2, H, generator=g).double()
    v = torch.randn(5, 2, H, generator=g).double()
    cfg = _config(moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
    with spy_layer0() as seen:
        upstream, ours = _layers(cfg)
        diff = _compare(upstream, ours, x, v, f"capacity bound rank {rank}")
        _, dynamic = _layers(cfg, max_rows=-1)
        ours.zero_grad(set_to_none=True)
        got, want = _run(ours, x, v), _run(dynamic, x, v)
    T = x.shape[0] * x.shape[1]
    bound = comet_nn.worst_case_rows(T, K, E, world, get_capacity(T * K, E, 0.5))
    assert bound < comet_nn.worst_case_rows(T, K, E, world)  # the capacity tightens it
    assert seen[:2] == [(bound, bound)] * 2 and seen[2][0] is None, seen
    assert got.keys() == want.keys()
    for key, w in want.items():
        torch.testing.assert_close(got[key], w, atol=0, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
    return diff


def test_capacity_factor_takes_the_sync_free_path():
    run_ranks(_capacity_bound_checks, 2, timeout=150)


def _unpatched_checks(rank, world, etp=1):
    """CometMoELayer from README's spec on CPU with upstream unpatched (this process never imports
    tests/megatron_cpu_patches.py): it builds (no token dispatcher, no CUDA stream even with
    moe_shared_expert_overlap) and runs forward + backward, also with expert tensor parallelism
    (etp); upstream's own layer does not build."""
    import sys

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import build_module

    from comet.megatron import CometMoELayer, comet_moe_spec

    assert not torch.cuda.is_available()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world // etp,
                                             expert_tensor_parallel_size=etp,
                                             create_gloo_process_groups=False)
    parallel = dict(expert_model_parallel_size=world // etp, expert_tensor_parallel_size=etp)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(5, 2, H, generator=g)
    v = torch.randn(5, 2, H, generator=g)
    for over in ({}, dict(moe_shared_expert_intermediate_size=8, moe_shared_expert_overlap=True),
                 dict(moe_expert_capacity_factor=0.5)):
        layer = build_module(comet_moe_spec(spec).submodules.mlp,  # float32, as a user runs it
                             config=_config(params_dtype=torch.float32, **over, **parallel))
        assert layer.comet_tp_size == etp
        assert type(layer) is CometMoELayer and layer.token_dispatcher is None
        res = _run(layer, x, v)
        out = res.pop("out")
        res.pop("dx")
        assert out.dtype == torch.float32
        assert torch.isfinite(out).all() and out.abs().max() > 0.1, over
        assert all(g is not None and g.abs().max() > 0 for g in res.values()), over
    assert SharedExpertMLP.stream is None  # upstream's overlap stream was never created
    try:
        build_module(spec.submodules.mlp, config=_config(**parallel))  # upstream's own
        upstream_builds = True
    except Exception:  # its alltoall dispatcher creates a CUDA stream
        upstream_builds = False
    assert "tests.megatron_cpu_patches" not in sys.modules
    return upstream_builds


@pytest.mark.parametrize("world,etp", [(1, 1), (2, 1), (2, 2)])
def test_comet_layer_runs_without_upstream_patches(world, etp):
    assert run_ranks(_unpatched_checks, world, etp, timeout=150) == [False] * world


def test_readme_megatron_example_runs_as_written():
    """The Megatron guide's code block (docs/training.md), verbatim, in a fresh process on one
    gloo rank (CPU)."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    from tests.dist_utils import free_port

    root = pathlib.Path(__file__).resolve().parents[1]
    readme = (root / "docs" / "training.md").read_text()
    section = readme[readme.index("## Megatron-core"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "comet_moe_spec" in code and "get_gpt_layer_local_spec" in code
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", code + "\nprint('README example ran')"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "README example ran" in done.stdout, done.stderr[-3000:]


# -- expert tensor parallelism (expert_tensor_parallel_size > 1) ----------------------------------

ETP = 2


def _setup_etp(world):
    from megatron.core import parallel_state

    from tests import megatron_cpu_patches

    megatron_cpu_patches.apply()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world // ETP,
                                             expert_tensor_parallel_size=ETP,
                                             create_gloo_process_groups=False)
    return world // ETP


def _etp_checks(rank, world):
    """EP = world / 2 x ETP 2: every rank its own tokens, each rank holds its tp shard of its EP
    rank's experts (SequentialMLP: linear_fc1 column-parallel with its gate and up shards together,
    linear_fc2 row-parallel; GroupedMLP the same shards in its flat storage); comet's layer on Megatron's expert tensor-and-model-parallel group
    equals upstream's layer (alltoall dispatcher: EP all-to-all, then all-gather / reduce-scatter
    over the expert TP group), forward and backward, float64 and bf16, dropless and with a capacity;
    then with attention TP = ETP, with sequence parallelism and shared experts, and without it in
    eval mode."""
    from tests import megatron_cpu_patches

    ep = _setup_etp(world)
    etp = dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=ETP)
    g = torch.Generator().manual_seed(41 + rank)  # each rank its own tokens, and as many
    x = torch.randn(4 + rank, 2, H, generator=g).double()
    v = torch.randn(4 + rank, 2, H, generator=g).double()
    upstream, ours = _layers(_config(**etp))
    assert ours.comet_tp_size == ETP and ours.num_local_experts == E // ep
    assert torch.distributed.get_process_group_ranks(ours.comet_group) == list(range(world))
    fc1 = ours.experts.local_experts[0].linear_fc1.weight
    fc2 = ours.experts.local_experts[0].linear_fc2.weight
    assert fc1.shape == (2 * FFN // ETP, H) and fc2.shape == (H, FFN // ETP)  # the tp shards
    diffs = {"fp64": _compare(upstream, ours, x, v, f"etp rank {rank}")}
    upstream, ours = _layers(_config(params_dtype=torch.bfloat16, bf16=True,
                                     moe_router_dtype="fp32", **etp))
    # atol 6e-2 (bf16, here and for GroupedMLP below): comet's h is the SwiGLU fused into
    # layer0, rounded to bf16 once from the fp32 accumulators (and its backward takes the fp32
    # pre-activation), upstream rounds fc1's output, then silu, then the product: a bf16 ulp or
    # two per element of h, which the expert weight gradients (up to ~16) sum over the rows
    diffs["bf16"] = _compare(upstream, ours, x.bfloat16(), v.bfloat16(), f"etp bf16 rank {rank}",
                             atol=6e-2, rtol=2e-2)
    # GroupedMLP (bf16 only upstream): weight1 [H, E_local * 2F / t] / weight2 [E_local * F / t,
    # H], each expert's columns its gate shard then its up shard, read in place as transposed w0/w1
    megatron_cpu_patches.use_torch_grouped_gemm()
    upstream, ours = _layers(_config(params_dtype=torch.bfloat16, bf16=True,
                                     moe_router_dtype="fp32", moe_grouped_gemm=True, **etp),
                             grouped=True)
    el = E // ep
    assert type(ours.experts).__name__ == "GroupedMLP"
    assert ours.experts.weight1.shape == (H, el * 2 * FFN // ETP)
    assert ours.experts.weight2.shape == (el * FFN // ETP, H)
    diffs["grouped_bf16"] = _compare(upstream, ours, x.bfloat16(), v.bfloat16(),
                                     f"etp grouped bf16 rank {rank}", atol=6e-2, rtol=2e-2)
    # the capacity's row bound (the sync-free path) needs as many tokens on every rank
    from comet import nn as comet_nn
    from megatron.core.transformer.moe.moe_utils import get_capacity

    from tests.layer0_spy import spy_layer0

    with spy_layer0() as seen:
        upstream, ours = _layers(_config(moe_expert_capacity_factor=0.5,
                                         moe_token_drop_policy="probs", **etp))
        with torch.no_grad():
            assert (ours.route(x[:4])[1].sum(1) < K).any(), "the capacity should drop slots"
        diffs["capacity"] = _compare(upstream, ours, x[:4], v[:4], f"etp capacity rank {rank}")
    bound = comet_nn.worst_case_rows(8, K, E, world, get_capacity(8 * K, E, 0.5), tp_size=ETP)
    assert seen == [(bound, bound)], (seen, bound)  # E_local = E / EP, from all W ranks

    # attention tensor parallelism = ETP with sequence parallelism (Megatron's usual MoE setup):
    # each rank's input is its slice of the sequence (as many tokens on the TP ranks), the shared
    # experts are Megatron's sequence-parallel MLP
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(ETP, 1, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=ETP,
                                             create_gloo_process_groups=False)
    upstream, ours = _layers(_config(tensor_model_parallel_size=ETP, sequence_parallel=True,
                                     moe_shared_expert_intermediate_size=8, **etp))
    assert ours.shared_experts.linear_fc1.weight.shape == (2 * 8 // ETP, H)  # TP-sharded, gated
    diffs["attn_tp_sp"] = _compare(upstream, ours, x[:4], v[:4], f"attn tp + sp rank {rank}")
    # without sequence parallelism (inference: upstream refuses it in training) the ranks of an
    # attention TP group hold the same tokens; each gets its full result
    g = torch.Generator().manual_seed(51 + rank // ETP)
    x, v = (torch.randn(4, 2, H, generator=g).double() for _ in range(2))
    upstream, ours = _layers(_config(tensor_model_parallel_size=ETP, **etp))
    upstream.eval(), ours.eval()
    diffs["attn_tp_eval"] = _compare(upstream, ours, x, v, f"attn tp eval rank {rank}")
    return diffs


@pytest.mark.parametrize("world", [2, 4])  # (EP, ETP) = (1, 2) and (2, 2)
def test_matches_megatron_expert_tensor_parallel(world):
    diffs = run_ranks(_etp_checks, world, timeout=150)
    assert all(set(d) == {"fp64", "bf16", "grouped_bf16", "capacity", "attn_tp_sp",
                                "attn_tp_eval"} for d in diffs)
    print(diffs)


def _etp_refusal_checks(rank, world):
    """A pg_collection whose expert tensor-and-model-parallel group is not TP-innermost (here the
    2 ranks in reverse order) or a buffer of the wrong world: a clear error at construction."""
    import copy

    import comet
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    _setup_etp(world)
    cfg = _config(expert_model_parallel_size=world // ETP, expert_tensor_parallel_size=ETP)
    pgs = copy.copy(get_default_pg_collection())
    pgs.tp_ep = torch.distributed.distributed_c10d._new_group_with_tag(
        list(reversed(range(world))), sort_ranks=False)
    assert torch.distributed.get_rank(pgs.tp_ep) == world - 1 - rank
    with pytest.raises(ValueError, match=r"TP-innermost \(rank = ep_rank \* 2 \+ tp_rank\)"):
        _layers(cfg, pg_collection=pgs)
    with pytest.raises(ValueError, match="buffer has world 1 but the layer's group has 2 ranks"):
        _layers(cfg, buffer=comet.Buffer.simulated_world(1)[0])


def test_expert_tensor_parallel_group_order_is_checked():
    run_ranks(_etp_refusal_checks, 2, timeout=150)
