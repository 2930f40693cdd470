"""torchtitan 0.3.0's DeepSeek-V3 models trained on one GPU with torchtitan's MoE and with spmdmoe's
(``swap_moe``), side by side in one process.

    python benchmarks/torchtitan_model.py --part debug  [--out FILE]   # the whole debug model, FlexAttention
    python benchmarks/torchtitan_model.py --part parity [--out FILE]   # DeepSeek-MoE-16B layer shape, 50 steps
    python benchmarks/torchtitan_model.py --part bench  [--out FILE]   # the same model: tokens/s, peak memory
    python benchmarks/torchtitan_model.py --smoke                       # CPU, tiny: every part, no timing
    torchrun --nproc-per-node 4 benchmarks/torchtitan_model.py --part ep [--ep 4]   # NCCL: torchtitan's parallelize
    torchrun --nproc-per-node 4 benchmarks/torchtitan_model.py --part ep --flavor 16B --layers 8 --seq 4096 \
        --batch 2 --ac full --lr 3e-4                                                # a whole-model table

Training is torchtitan's one-device setup in a plain loop (its Trainer imports datasets): fp32
parameters, the forward and the loss under ``torch.autocast(bfloat16)`` (torchtitan's
``mixed_precision_param`` off FSDP), AdamW, torchtitan's own ``register_moe_load_balancing_hook``. Both
models are built on meta from one config, one of them swapped, and initialised by torchtitan's
``init_states`` from one seed, so they start bitwise equal. The data: a few fixed random batches cycled
(the loss falls as the model learns them).

* ``debug``: torchtitan's whole ``debugmodel`` (6 blocks, FlexAttention with its document masks), 20
  steps eager, then 20 steps with every block compiled as torchtitan compiles it
  (``block.compile(fullgraph=True)``, ``capture_scalar_outputs``), fresh models each.
* ``parity``: the DeepSeek-MoE-16B flavor (dim 2048, 64 experts of hidden 1408, top 6, 2 shared
  experts, vocabulary 102400) cut to its first ``--layers`` blocks (the first dense), with torchtitan's
  causal SDPA attention (no FlexAttention autotuning); 50 eager steps, |loss difference| <= 1 % of
  torchtitan's loss at every step, and every parameter's gradient at the first step within 5 % (relative,
  ||diff|| / ||torchtitan's||: the swap keeps torchtitan's parameter names) of torchtitan's.
* ``ep`` (under ``torchrun``, one GPU a process): torchtitan's debug model (``--flavor``, ``--layers``) through
  torchtitan's own ``parallelize_fn`` as its Trainer calls it, both models: the spec's own and
  ``swapped_model_spec``'s (it swaps, then runs torchtitan's), each built as ``examples/train_titan_moe.py`` builds
  its model (its ``parallel_dims`` and ``build``). FSDP over every rank (``dp_shard``), EP
  ``--ep`` (default: every rank; ``--ep 2`` on 4 GPUs: dp 2 x ep 2), torchtitan's default SPMD backend
  (``partial_dtensor`` on torch < 2.13, whose FSDP2 lacks the default's ``dp_mesh_dims``; with EP there the
  experts are a nested FSDP unit, ``titan_expert_fsdp.py``), bf16
  parameters and fp32 reductions (its ``mixed_precision_*`` defaults); each rank its own batch, the loss a
  sum over the rank's tokens / the step's tokens (torchtitan turns FSDP's division off), AdamW with its
  load-balancing hook, no clipping. Both start from torchtitan's weights; ``--steps`` steps, |loss
  difference| <= 1 % of torchtitan's loss at every step and the first step's gradients within 50 % (each
  parameter, norms over all ranks' shards; gross errors only: with bf16 parameters torchtitan's gate GEMM runs in
  bf16 and ours in fp32, so near-tie tokens choose other experts, ``GRAD_TOLERANCE_BF16_PARAMS``); then, only if
  both hold, the whole-model table (``whole_model_table``), steps timed interleaved: tokens/s per GPU, MFU by
  torchtitan's own count, step peak memory, kernel launches a step (the smoke: one timed step each, on CPU).
  ``--flavor 16B --layers N`` is the DeepSeek-MoE-16B model cut to N blocks; ``--ac`` torchtitan's activation
  checkpointing; ``--ep-mode`` and ``--expert-precision`` ours (FP8: the loss gate holds, the gradient gate is the
  bf16-parameter one).
* ``bench``: that model, every block compiled as torchtitan does, both models resident; the first (compiling)
  step's loss within 1 % and every parameter's gradient within 5 % of torchtitan's, else nothing is timed; a training step
  (forward, backward, AdamW step) of each timed interleaved (``timing.timed``: shuffled order, median);
  tokens/s and peak memory: the most a step allocates above what is resident (weights, gradients,
  optimizer state: reported beside it).

torch 2.11 (the GPU hosts) lacks names torchtitan 0.3.0 uses; ``shim_torch`` (spmdmoe's, in
``spmdmoe/integrations/_torch_compat.py``) supplies them before torchtitan is imported. torchtitan is an
optional extra: without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from timing import report, timed, timed_host  # noqa: E402

from spmdmoe.integrations._torch_compat import shim_torch  # noqa: E402

TOLERANCE = 0.01  # |loss difference| / loss at every step
GRAD_TOLERANCE = 5e-2  # ||diff|| / ||torchtitan's|| of each parameter's gradient at the first step (fp32 parameters)
# the same with bf16 parameters (the ep part: FSDP's param_dtype): torchtitan's gate GEMM then runs in bf16 and ours in
# fp32 (router_dtype="float32"), so tokens near a tie choose other experts, which moves whole expert gradients (CPU
# smoke, dp 2 x ep 2: experts' gradients 0.15 apart, the router's 0.26; 5e-3 with fp32 parameters). Gross errors
# only: a gradient skipped (zeros) is 1 apart
GRAD_TOLERANCE_BF16_PARAMS = 0.5


def keep_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name (this rank's shard of a DTensor's; a missing one as zeros), copied."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad
        out[name] = (g.to_local() if isinstance(g, DTensor) else g).detach().clone()
    return out


def grad_error(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ||diff|| / ||ref|| of one parameter's gradient (the swap keeps torchtitan's parameter names; under
    FSDP / EP both models are sharded alike, so the norms are summed over the ranks' shards), and its name; inf
    where a parameter is missing on one side or of another shape."""
    import torch.distributed as dist

    names = sorted(set(ours) | set(ref))
    sums = torch.zeros(len(names), 2, dtype=torch.float64)
    for i, n in enumerate(names):
        a, b = ours.get(n), ref.get(n)
        if a is None or b is None or a.shape != b.shape:
            sums[i] = torch.tensor([float("inf"), 1.0])
            continue
        sums[i] = torch.stack([(a.double() - b.double()).pow(2).sum(), b.double().pow(2).sum()]).cpu()
    if dist.is_initialized():  # every rank: the same names (the same model), its own shards
        sums = sums.to(next(iter(ref.values())).device)
        dist.all_reduce(sums)
        sums = sums.cpu()
    rel = [(d / r) ** 0.5 if r > 0 else (float("inf") if d > 0 else 0.0) for d, r in sums.tolist()]
    worst = max(range(len(rel)), key=rel.__getitem__, default=None)
    return (0.0, "") if worst is None else (rel[worst], names[worst])


def compile_blocks(model: torch.nn.Module, device: str) -> None:
    """Every block compiled as torchtitan 0.3.0 compiles it; on CPU (the smoke run) with ``aot_eager``: the same
    Dynamo graphs and autograd, without inductor's C++ builds (over half of the smoke's minutes on 2 cores), whose
    CPU code is not what a GPU runs."""
    torch._dynamo.config.capture_scalar_outputs = True
    for block in model.layers.values():
        block.compile(fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")


class Trainer:
    """One model's training step: autocast(bf16) forward and loss, backward, AdamW with torchtitan's hook."""

    def __init__(self, model: torch.nn.Module, lr: float, flex: bool):
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        from torchtitan_models import NoParallelism

        self.model, self.flex = model, flex
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        register_moe_load_balancing_hook(self.opt, [model], NoParallelism())

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        x, y = tokens[:, :-1], tokens[:, 1:]
        extra = {}
        if self.flex:
            positions = torch.arange(x.shape[1], device=x.device).expand_as(x)
            extra = {"positions": positions, "attention_masks": self.model.get_attention_masks(positions=positions)}
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            logits = self.model(x, **extra)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def step(self, tokens: torch.Tensor, grads: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """One training step; ``grads``: filled with the step's parameter gradients (``keep_grads``)."""
        loss = self.loss(tokens)
        loss.backward()
        if grads is not None:
            grads.update(keep_grads(self.model))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def resident_gib(self) -> float:
        """Weights, gradients (allocated for the step) and AdamW's state."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        state = sum(t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values()
                    if torch.is_tensor(t))
        return (2 * params + state) / 2**30


def pair(config: Any, device: str) -> dict[str, torch.nn.Module]:
    """torchtitan's model and the swapped one from one seed (``tests/torchtitan_models.pair``), by name."""
    from torchtitan_models import pair as built

    return dict(zip(("torchtitan", "spmdmoe"), built(config, 0, device)))


def batches(vocab: int, batch: int, seq: int, count: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device) for _ in range(count)]


def track(config: Any, steps: int, data: list[torch.Tensor], device: str, lr: float, flex: bool,
          compiled: bool) -> tuple[list[float], list[float], tuple[float, str]]:
    """``steps`` steps of each model (torchtitan's first, then ours) on the same batches: their losses, and the
    first step's parameter gradients compared (``grad_error``)."""
    losses, grads = [], []
    for model in pair(config, device).values():
        if compiled:
            compile_blocks(model, device)
        trainer = Trainer(model, lr, flex)
        grads.append({})
        losses.append(torch.stack([trainer.step(data[i % len(data)], grads[-1] if i == 0 else None)
                                   for i in range(steps)]).tolist())
        del trainer, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return losses[0], losses[1], grad_error(grads[1], grads[0])


def tracking_table(title: str, runs: dict[str, tuple[list[float], list[float], tuple[float, str]]],
                   grad_tolerance: float = GRAD_TOLERANCE) -> tuple[str, bool]:
    lines = [title, "", "| run | steps | first loss tt / ours | last loss tt / ours | max abs(loss diff) / loss | "
             "at step | first step's gradients: max rel error (parameter) |", "|---|---|---|---|---|---|---|"]
    ok = True
    for name, (tt, ours, (grad_rel, where)) in runs.items():
        rel = [abs(a - b) / abs(a) for a, b in zip(tt, ours)]
        worst = max(range(len(rel)), key=rel.__getitem__)
        ok &= max(rel) <= TOLERANCE and tt[-1] < tt[0] and grad_rel <= grad_tolerance
        lines.append(f"| {name} | {len(tt)} | {tt[0]:.4f} / {ours[0]:.4f} | {tt[-1]:.4f} / {ours[-1]:.4f} | "
                     f"{rel[worst]:.2e} | {worst} | {grad_rel:.2e} ({where}) |")
    lines.append(f"\n{'OK' if ok else 'FAILED'}: every step within {TOLERANCE:.0%} of torchtitan's loss, and the "
                 f"loss fell; every parameter's first-step gradient within {grad_tolerance:.0%} of torchtitan's")
    return "\n".join(lines), ok


def part_debug(args: argparse.Namespace, device: str) -> bool:
    from torchtitan_models import debug_config

    layers, steps = (2, 4) if args.smoke else (6, 20)
    config = debug_config(layers=layers, sdpa=args.smoke)  # CPU: FlexAttention has no backward there
    data = batches(config.vocab_size, 2 if args.smoke else 8, 32 if args.smoke else 512, 2, device)
    runs = {mode: track(config, steps, data, device, 1e-3, not args.smoke, mode == "compiled per block")
            for mode in ("eager", "compiled per block")}
    text, ok = tracking_table(f"torchtitan DeepSeek-V3 debugmodel, {layers} blocks, "
                              f"{'SDPA' if args.smoke else 'FlexAttention'}, {data[0].shape[0]} x "
                              f"{data[0].shape[1] - 1} tokens per step, AdamW lr 1e-3, autocast bf16", runs)
    report(text, args.out)
    return ok


def dsmoe16b(args: argparse.Namespace) -> tuple[Any, str]:
    """The model of ``parity`` and ``bench``, and its description."""
    from torchtitan_models import debug_config

    if args.smoke:  # the debug model's shapes: the 16B flavor's 102400-word vocabulary alone is too big for CPU
        return debug_config(layers=2), "torchtitan DeepSeek-V3 debugmodel cut to 2 blocks (smoke)"
    return (debug_config(layers=args.layers, flavor="16B"),
            f"torchtitan DeepSeek-V3, 16B flavor cut to {args.layers} blocks (1 dense, {args.layers - 1} MoE: "
            "64 experts 2048 -> 1408, top 6, 2 shared)")


def part_parity(args: argparse.Namespace, device: str) -> bool:
    config, name = dsmoe16b(args)
    steps = 6 if args.smoke else args.steps
    data = batches(config.vocab_size, args.batch, 32 if args.smoke else args.seq, 2 if args.smoke else 4, device)
    runs = {"eager": track(config, steps, data, device, 3e-4, False, False)}
    text, ok = tracking_table(f"{name}, SDPA, {args.batch} x {data[0].shape[1] - 1} tokens per step, AdamW lr "
                              "3e-4, autocast bf16", runs)
    report(text, args.out)
    return ok


def part_bench(args: argparse.Namespace, device: str) -> bool:
    config, name = dsmoe16b(args)
    data = batches(config.vocab_size, args.batch, 32 if args.smoke else args.seq, 4, device)
    trainers = {key: Trainer(model, 3e-4, False) for key, model in pair(config, device).items()}
    for trainer in trainers.values():
        compile_blocks(trainer.model, device)
    tokens = data[0][:, 1:].numel()
    grads: dict[str, dict[str, torch.Tensor]] = {key: {} for key in trainers}
    first = {key: trainer.step(data[0], grads[key]).item() for key, trainer in trainers.items()}  # compiles
    grad_rel, where = grad_error(grads["spmdmoe"], grads["torchtitan"])
    del grads
    gap = abs(first["spmdmoe"] - first["torchtitan"]) / abs(first["torchtitan"])
    check = (f"first step: loss rel gap {gap:.2e} (<= {TOLERANCE}), parameter gradients' max rel error {grad_rel:.2e} "
             f"({where}; <= {GRAD_TOLERANCE})")
    if not (gap <= TOLERANCE and grad_rel <= GRAD_TOLERANCE):
        report(f"{name}: FAILED, not timed: the compiled models differ: {check}", args.out)
        return False
    if args.smoke:
        print(f"OK: smoke, both models compiled per block and stepped: {first}; {check}")
        return True
    peak, resident = {}, {}
    for key, trainer in trainers.items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.step(data[1])
        torch.cuda.synchronize()
        peak[key] = (torch.cuda.max_memory_allocated() - base) / 2**30
        resident[key] = trainer.resident_gib()
    it = iter(range(1 << 30))

    def forward_backward(trainer: Trainer) -> None:
        trainer.loss(data[next(it) % len(data)]).backward()
        trainer.model.zero_grad(set_to_none=True)
    fns = {}
    for key, trainer in trainers.items():
        fns[f"{key} step"] = lambda t=trainer: t.step(data[next(it) % len(data)])
        fns[f"{key} fwd+bwd"] = lambda t=trainer: forward_backward(t)
    ms = timed(fns, args.iters, args.reps)
    lines = [f"{name}, SDPA, {args.batch} x {args.seq} = {tokens} tokens per step, fp32 weights + autocast bf16, every "
             f"block compiled (fullgraph), AdamW; timed interleaved, median of {args.reps} x {args.iters}", "",
             "| MoE | step ms | tokens/s | speedup | fwd+bwd ms | speedup | step peak GiB above resident | "
             "resident GiB |", "|---|---|---|---|---|---|---|---|"]
    for key in trainers:
        step, fb = ms[f"{key} step"], ms[f"{key} fwd+bwd"]
        lines.append(f"| {key} | {step:.2f} | {tokens / step * 1e3:,.0f} | {ms['torchtitan step'] / step:.3f} | "
                     f"{fb:.2f} | {ms['torchtitan fwd+bwd'] / fb:.3f} | {peak[key]:.2f} | {resident[key]:.2f} |")
    report("\n".join(lines), args.out)
    return True


def part_ep(args: argparse.Namespace, device: str) -> bool:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    from train_titan_moe import PEAK_BF16_TFLOPS, build, parallel_dims  # the example's model, as it builds it

    from titan_expert_fsdp import fsdp_meshes_per_parameter

    world, rank = dist.get_world_size(), dist.get_rank()
    ep = args.ep or world
    if args.smoke:
        args.layers, args.seq = 2, 32
    dims, parallelism = parallel_dims(ep, device, args.spmd_backend)
    backend = parallelism.spmd_backend
    # torch < 2.13: torchtitan's EP FSDP branch cannot run; the experts get a nested unit (titan_expert_fsdp.py)
    nested = ep > 1 and not fsdp_meshes_per_parameter()
    if nested and args.compile:  # tried: Dynamo cannot trace FSDP2's hooks on 2.11 (skip_fsdp_hooks=False)
        if rank == 0:
            report("not run: torchtitan 0.3.0 compiles each block with fullgraph=True, and on torch < 2.13 the "
                   "experts' own FSDP unit (the EP + FSDP layout this torch's FSDP2 has) breaks that graph at its "
                   "hooks; per-block compile with EP runs on torch >= 2.13 here, and by hand (EP without FSDP) in "
                   "tests/distributed/test_torchtitan.py", args.out)
        return False
    models, opts = {}, {}
    for key in ("torchtitan", "spmdmoe"):  # from one seed; flops_per_token: torchtitan's count (both: the same)
        models[key], vocab, flops_per_token = build(argparse.Namespace(**{**vars(args), "moe": key, "seed": 0}),
                                                    dims, parallelism, device)
    same = True  # both from torchtitan's weights (the swap draws the same numbers: checked, then made certain)
    with torch.no_grad():
        for (name, a), (_, b) in zip(models["torchtitan"].named_parameters(), models["spmdmoe"].named_parameters()):
            full = a.full_tensor() if isinstance(a, DTensor) else a
            mine = distribute_tensor(full, b.device_mesh, b.placements) if isinstance(b, DTensor) else full
            same &= bool(torch.equal(b, mine))
            b.copy_(mine)
    for key, model in models.items():
        opts[key] = torch.optim.AdamW(model.parameters(), lr=args.lr)
        register_moe_load_balancing_hook(opts[key], [model], dims)
    seq = args.seq
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    data = [torch.randint(0, vocab, (args.batch, seq + 1), generator=g).to(device)
            for _ in range(2 if args.smoke else 4)]  # cycled: the loss falls as the model learns them
    step_tokens = args.batch * seq * world

    def step(key: str, tokens: torch.Tensor, grads: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        logits = models[key](tokens[:, :-1])
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                                     reduction="sum")
        (loss_sum / step_tokens).backward()
        if grads is not None:
            grads.update(keep_grads(models[key]))
        opts[key].step()
        opts[key].zero_grad(set_to_none=True)
        return loss_sum.detach()

    steps = 6 if args.smoke else args.steps
    losses: dict[str, list[float]] = {key: [] for key in models}
    grads: dict[str, dict[str, torch.Tensor]] = {key: {} for key in models}  # the first step's
    for i in range(steps):
        for key in models:
            total = step(key, data[i % len(data)], grads[key] if i == 0 else None)
            dist.all_reduce(total)
            losses[key].append(total.item() / step_tokens)
    first_grads = grad_error(grads["spmdmoe"], grads["torchtitan"])
    del grads
    name = (f"torchtitan DeepSeek-V3 {args.flavor}, {args.layers} blocks, SDPA, {world} processes: FSDP over {world}, "
            f"EP {ep}{f' (dp {world // ep} x ep {ep} for the experts)' if 1 < ep < world else ''}, "
            f"{backend} backend{', blocks compiled' if args.compile else ''}, activation checkpointing {args.ac}, "
            f"our ep_mode {args.ep_mode}, our experts {args.expert_precision}"
            f"{', routed experts a nested FSDP unit (torch < 2.13: titan_expert_fsdp.py)' if nested else ''}; "
            f"{args.batch} x {seq} tokens a rank "
            f"a step, AdamW lr {args.lr}; weights bitwise equal after init: {'yes' if same else 'no (copied)'}")
    text, ok = tracking_table(name, {"eager" if not args.compile else "compiled": (losses["torchtitan"],
                                                                                    losses["spmdmoe"], first_grads)},
                              GRAD_TOLERANCE_BF16_PARAMS)
    if ok:  # timed only when both models train alike, gradients included (the smoke: once, for the table's code)
        it = iter(range(steps, 1 << 30))
        steps_of = {key: (lambda k=key: step(k, data[next(it) % len(data)])) for key in models}
        ms = timed_host(steps_of, 1, 1) if args.smoke else timed(steps_of, args.iters, args.reps)
        text += "\n\n" + whole_model_table(ms, steps_of, step_tokens / world, flops_per_token, device,
                                            PEAK_BF16_TFLOPS)
    if rank == 0:
        report(text, args.out)
    return ok


def whole_model_table(ms: dict[str, float], steps: dict[str, Callable[[], Any]], tokens_per_gpu: float,
                      flops_per_token: float, device: str, peak_tflops: float) -> str:
    """Per candidate: step ms, tokens/s per GPU, speedup over torchtitan's, MFU (``flops_per_token``: torchtitan's
    ``get_nparams_and_flops``, 6 x active non-embedding parameters plus attention, against ``peak_tflops``: the
    example's dense bf16 peak), the step's peak memory above what is resident (max over ranks) and kernel launches
    a step (``host_cost.launches_per_step``); on CPU (the smoke) the times only."""
    import torch.distributed as dist
    from host_cost import launches_per_step

    if device == "cpu":
        return "\n".join(["| MoE | step ms (CPU) | speedup |", "|---|---|---|"]
                         + [f"| {key} | {t:.1f} | {ms['torchtitan'] / t:.3f} |" for key, t in ms.items()])

    lines = ["| MoE | step ms | tokens/s per GPU | speedup | MFU | step peak GiB above resident (max over ranks) "
             "| launches a step |",
             "|---|---|---|---|---|---|---|"]
    for key, t in ms.items():
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()  # both models' weights and optimizer states
        torch.cuda.reset_peak_memory_stats()
        steps[key]()
        torch.cuda.synchronize()
        peak = torch.tensor((torch.cuda.max_memory_allocated() - resident) / 2**30, device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        launches = launches_per_step(steps[key], steps=1)
        rate = tokens_per_gpu / t * 1e3
        lines.append(f"| {key} | {t:.2f} | {rate:,.0f} | {ms['torchtitan'] / t:.3f} | "
                     f"{rate * flops_per_token / (peak_tflops * 1e12):.1%} | {peak.item():.1f} | {launches:.0f} |")
    return "\n".join(lines)


PARTS: dict[str, Callable[[argparse.Namespace, str], bool]] = {
    "debug": part_debug, "parity": part_parity, "bench": part_bench, "ep": part_ep}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=list(PARTS), action="append",
                   help="default: debug, parity, bench (ep runs under torchrun, alone)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, every part, no timing")
    p.add_argument("--layers", type=int, default=4, help="blocks of the 16B flavor (the first dense)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--ep", type=int, default=None, help="ep part: the EP degree (default: every rank)")
    p.add_argument("--flavor", default="debugmodel", help="ep part: torchtitan's DeepSeek-V3 flavor")
    p.add_argument("--lr", type=float, default=8e-4, help="ep part: AdamW's learning rate")
    p.add_argument("--compile", action="store_true", help="ep part: torchtitan compiles each block")
    p.add_argument("--spmd-backend", default=None, help="ep part: torchtitan's SPMD backend (default its own)")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none",
                   help="ep part: torchtitan's activation checkpointing")
    p.add_argument("--ep-mode", choices=["sync", "sync_free"], default="sync", help="ep part: ours")
    p.add_argument("--expert-precision", choices=["bf16", "fp8_rowwise"], default="bf16",
                   help="ep part: our routed experts (fp8_rowwise: the weight cache on, FSDP re-gathers into it)")
    args = p.parse_args()
    shim_torch()
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("torchtitan is not installed (pip install '.[torchtitan]', or --no-deps .whl/*.whl): nothing to run")
        return 0
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.batch = 2
    parts = args.part or [name for name in PARTS if name != "ep"]
    if "ep" in parts:
        if parts != ["ep"]:
            print("--part ep runs alone (under torchrun)", file=sys.stderr)
            return 2
        return part_ep_main(args, device)
    report(f"## torchtitan models with spmdmoe's MoE ({datetime.date.today()}, "
           f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}; "
           f"`python benchmarks/torchtitan_model.py {' '.join(sys.argv[1:])}`)", args.out)
    ok = [PARTS[name](args, device) for name in parts]
    return 0 if all(ok) else 1


def part_ep_main(args: argparse.Namespace, device: str) -> int:
    """The ep part under torchrun: the process group, the part, a clean end (``spmdmoe.shutdown``)."""
    import os

    import torch.distributed as dist

    if "RANK" not in os.environ:
        print("--part ep runs on several processes: torchrun --nproc-per-node N benchmarks/torchtitan_model.py "
              "--part ep", file=sys.stderr)
        return 2
    if device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        report(f"## torchtitan's parallelize with spmdmoe's MoE ({datetime.date.today()}, {dist.get_world_size()}x "
               f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}; "
               f"`torchrun --nproc-per-node {dist.get_world_size()} benchmarks/torchtitan_model.py "
               f"{' '.join(sys.argv[1:])}`)", args.out)
    return 0 if part_ep(args, device) else 1


if __name__ == "__main__":
    from spmdmoe import shutdown

    shutdown(main())
