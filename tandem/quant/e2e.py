"""End-to-end tuning of the group scales and zero points by distillation (in the spirit of
EfficientQAT's E2E-QP step, Chen et al. 2024).

With a quantized model's integer codes fixed, each group's weight is linear in its FP16 scale and
zero point (the value of code 0):

    w[n, k] = q[n, k] * scale[n, g] + min[n, g],   g = k // group_size

so the scales and zero points of every quantized linear layer can be trained together by plain
gradient descent (no straight-through rounding of codes). The loss is the KL divergence from the
float model's next-token distribution to the quantized model's, on the calibration text: the
float model is the teacher, no label is read. Parametrised relative to the start,

    scale = scale0 * (1 + a),   min = min0 + b * scale0 * 2**bits / 2     (a, b start at 0; Adam)

so one learning rate means the same relative change for every group (b in units of half the
group's range, about the size of a typical zero point, so the FP16 rounding of scale and min is
about as coarse in a as in b), and the FP16 rounding the
checkpoint stores is applied in the forward pass (straight through), so the trained values are the
stored ones. The codes, bits, group size and packing are unchanged: the result is an ordinary
`QuantizedWeight` checkpoint for the same kernels.

With `codes=True` the integer codes are trained too (quantization-aware training with
straight-through rounding, as in LLM-QAT / EfficientQAT's Block-AP, here end to end): each code
gets a real-valued latent `c`, starting at the code itself, and the forward pass uses

    q = clamp(round(c), 0, 2**bits - 1)       (gradient straight through the rounding)

so a code changes when its latent crosses a half-integer. The latents have their own learning
rate (`codes_lr`, in code units per Adam step); the result is still an ordinary checkpoint (the
rounded codes, packed).

The calibration text is small (a few thousand tokens of one kind), and a model tuned on it alone
drifts towards it. Sequences sampled from the float model itself (`sample_sequences`: data-free
distillation text, as in LLM-QAT) add varied text. The last `val_seqs` sequences are held out:
every `eval_every` steps the KL on them is measured and the best state is kept (early stopping);
if no step improves on the start, the start is returned unchanged. `tandem quantize` puts the
sampled sequences last, so with them the held-out sequences are sampled ones, of the same kind as
most of the training text and not part of the calibration file the base method fitted.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.formats.weight import QuantizedWeight, pack
from tandem.model.config import ModelConfig
from tandem.model.rotary import cos_sin_table
from tandem.quant.autoround import decoder_layer
from tandem.quant.walk import _rms_norm

_GRAPH_WARMUP_STEPS = 3  # eager steps before the training step is captured as a CUDA graph


@dataclass
class E2EReport:
    """Held-out KL (float model -> quantized model, nats per token) at each evaluation."""

    history: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out KL)
    best_step: int = 0
    start_kl: float = 0.0
    best_kl: float = 0.0
    train_seqs: int = 0
    val_seqs: int = 0
    seconds: float = 0.0
    stopped_at: int | None = None  # the step at which the time limit stopped tuning
    lr_factor: float = 1.0  # the learning rates' last factor (the cosine schedule's decay)


def check_options(
    steps: int, lr: float, batch: int, val_seqs: int, eval_every: int, generated: int = 0
) -> None:
    """Raise ValueError with an actionable message for unusable hyper-parameters."""
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"e2e steps must be an integer >= 0, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"e2e lr must be > 0, got {lr!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"e2e batch must be at least 1 calibration sequence, got {batch!r}")
    if not isinstance(val_seqs, int) or val_seqs < 1:
        raise ValueError(
            f"e2e needs at least 1 held-out calibration sequence for early stopping, got "
            f"{val_seqs!r}"
        )
    if not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"e2e eval_every must be an integer >= 1, got {eval_every!r}")
    if not isinstance(generated, int) or generated < 0:
        raise ValueError(f"e2e generated sequences must be an integer >= 0, got {generated!r}")


class GroupParams:
    """One quantized layer's codes and trainable (relative) scale and zero-point offsets; with
    `codes`, real-valued latents of the codes too (see the module docstring)."""

    def __init__(self, qw: QuantizedWeight, codes: bool = False):
        n, kp, g = qw.out_features, qw.padded_in_features, qw.group_size
        self.qw = qw
        self.levels = (1 << qw.bits) - 1
        self.codes = qw.codes().to(torch.uint8).view(n, kp // g, g)  # [N, G, g]
        self.scale0 = qw.scales.float()
        self.min0 = qw.mins.float()
        self.unit = self.scale0 * (1 << (qw.bits - 1))  # half the group's range
        self.a = torch.zeros_like(self.scale0, requires_grad=True)
        self.b = torch.zeros_like(self.scale0, requires_grad=True)
        self.c = self.codes.float().requires_grad_(True) if codes else None

    def grid_params(self) -> list[torch.Tensor]:
        return [self.a, self.b]

    def params(self) -> list[torch.Tensor]:
        return [self.a, self.b] + ([self.c] if self.c is not None else [])

    def current_codes(self) -> torch.Tensor:
        """[N, G, g] float codes of the forward pass (straight-through rounding of the latents)."""
        if self.c is None:
            return self.codes.float()
        c = self.c.clamp(0, self.levels)
        return c + (torch.round(c) - c).detach()

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 scale and zero point [N, G] of the current offsets (before FP16)."""
        return self.scale0 * (1 + self.a), self.min0 + self.unit * self.b

    def weight(self) -> torch.Tensor:
        """The float weight [N, K] the packed result will hold, differentiable in a and b."""
        scale, zero = self.grid()
        scale = scale + (_fp16(scale) - scale).detach()
        zero = zero + (zero.to(torch.float16).float() - zero).detach()
        w = self.current_codes() * scale[..., None] + zero[..., None]
        return w.flatten(1)[:, : self.qw.in_features]

    @torch.no_grad()
    def packed(self) -> QuantizedWeight:
        scale, zero = self.grid()
        qweight = self.qw.qweight
        if self.c is not None:
            codes = self.current_codes().round().to(torch.int32).flatten(1)
            qweight = pack(codes, self.qw.bits)
        return QuantizedWeight(
            qweight,
            _fp16(scale).to(torch.float16),
            zero.to(torch.float16),
            self.qw.bits,
            self.qw.group_size,
            self.qw.in_features,
            self.qw.zero_point,
        )


def _fp16(scale: torch.Tensor) -> torch.Tensor:
    """FP16 rounding of a scale, kept positive (a zero or underflowing scale: the smallest normal)."""
    tiny = torch.finfo(torch.float16).tiny
    return scale.clamp(min=tiny).to(torch.float16).float().clamp(min=tiny)


def forward_logits(
    w: dict[str, torch.Tensor], cfg: ModelConfig, ids: torch.Tensor, cos, sin
) -> torch.Tensor:
    """Logits [S*L, V] of sequences `ids` [S, L] (each causal on its own), float32, differentiable."""
    s, n = ids.shape
    h = F.embedding(ids, w["model.embed_tokens.weight"]).reshape(s * n, -1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {k[len(p) :]: v for k, v in w.items() if k.startswith(p)}
        h = decoder_layer(layer, cfg, h, cos, sin, s)
    h = _rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps)
    head = w.get("lm_head.weight")
    if cfg.tie_word_embeddings or head is None:
        head = w["model.embed_tokens.weight"]
    return h @ head.T


@torch.inference_mode()
def sample_sequences(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    count: int,
    length: int,
    seed: int = 0,
    temperature: float = 1.0,
    batch: int = 16,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Token ids [count, length] sampled from the model itself (data-free distillation text, as
    in LLM-QAT, Liu et al. 2023): each sequence starts from a token drawn uniformly from the
    vocabulary, then every next token is sampled from the model at `temperature`. On `device`
    (its own random generator: a GPU draws other sequences than the CPU for one seed); the ids
    come back on the CPU."""
    from tandem.kv.cache import KVCache
    from tandem.model.llama import AttentionMetadata, LlamaModel

    model = LlamaModel(cfg, weights, torch.float32, device, length)
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = 16
    nb = (length + bs - 1) // bs
    out = []
    for a in range(0, count, batch):
        b = min(batch, count - a)
        kv = KVCache.allocate(
            cfg.num_layers, b * nb, bs, cfg.num_kv_heads, cfg.head_dim, torch.float32, device
        )
        tables = torch.arange(b * nb, device=device).view(b, nb)
        seqs = torch.randint(0, cfg.vocab_size, (b, 1), generator=gen, device=device)
        for pos in range(length - 1):
            meta = AttentionMetadata(
                slot_mapping=tables[:, pos // bs] * bs + pos % bs,
                block_tables=tables,
                context_lens=torch.full((b,), pos + 1, device=device),
                context_lens_list=[pos + 1] * b,
                query_start_loc=list(range(b + 1)),
                decode_only=True,
            )
            h = model.forward(seqs[:, pos], torch.full((b,), pos, device=device), kv, meta)
            probs = torch.softmax(model.logits(h).float() / temperature, -1)
            seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=gen)], 1)
        out.append(seqs.cpu())
    return torch.cat(out)


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """float32 matrix products in TF32 on CUDA inside the block (when enabled: faster e2e steps,
    about 1e-3 relative per product, far finer than the gradient steps), the process's setting
    restored after it."""
    prev = torch.backends.cuda.matmul.allow_tf32
    if enabled:
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def e2e_tune(
    float_weights: dict[str, torch.Tensor],
    quantized: dict[str, torch.Tensor | QuantizedWeight],
    cfg: ModelConfig,
    calib: torch.Tensor,  # [S, L] token ids
    steps: int = 200,
    lr: float = 1e-3,
    batch: int = 2,
    val_seqs: int = 4,
    eval_every: int = 20,
    seed: int = 0,
    log=None,
    codes: bool = False,
    codes_lr: float = 1e-3,
    cosine: bool = False,
    time_limit_s: float | None = None,
    cuda_graph: bool | None = None,
) -> tuple[dict[str, torch.Tensor | QuantizedWeight], E2EReport]:
    """`quantized` with the scales and zero points of its decoder-layer QuantizedWeights tuned to
    bring its next-token distribution to `float_weights`' on `calib`; see the module docstring.
    Float tensors and other quantized tensors (head, embedding) are returned as given. The last
    `val_seqs` sequences of `calib` are held out for early stopping. `codes`: train the codes
    too, their latents at `codes_lr`. `cosine`: the learning rates decay to 0 along a half cosine
    over `steps`, or over `time_limit_s` where that ends first (else constant). `time_limit_s`: stop after the first evaluation past this many
    seconds of tuning (the best state so far is kept). Runs on the device of `float_weights`.
    `cuda_graph` (default: on CUDA): after a few eager warm-up steps, each training step (forward,
    backward and the Adam update) is one CUDA graph replay: a step is ~10k small kernels, and
    eager PyTorch spent most of a step launching them (the GPU idle). The same arithmetic, in the
    same order."""
    check_options(steps, lr, batch, val_seqs, eval_every)
    if codes and not codes_lr > 0:
        raise ValueError(f"e2e codes lr must be > 0, got {codes_lr!r}")
    s, n = calib.shape
    if s <= val_seqs:
        raise ValueError(
            f"e2e holds out {val_seqs} of {s} calibration sequences and has none left to train "
            "on: give more calibration text, lower --calib-seq-len or --e2e-val-seqs"
        )
    t_start = time.monotonic()
    teacher = {k: v.float() for k, v in float_weights.items() if isinstance(v, torch.Tensor)}
    dev = teacher["model.embed_tokens.weight"].device
    graphed = dev.type == "cuda" if cuda_graph is None else cuda_graph
    if graphed and dev.type != "cuda":
        raise ValueError(f"e2e cuda_graph needs the weights on a CUDA device, they are on {dev}")
    calib = calib.to(dev)
    train, val = calib[: s - val_seqs], calib[s - val_seqs :]
    fixed = {}
    params: dict[str, GroupParams] = {}
    for k, v in quantized.items():
        if isinstance(v, QuantizedWeight) and k.startswith("model.layers."):
            params[k] = GroupParams(v.to(dev), codes)
        elif isinstance(v, QuantizedWeight):
            fixed[k] = v.dequantize(torch.float32).to(dev)
        else:
            fixed[k] = v.float().to(dev)
    base_lrs = [lr] + ([codes_lr] if codes else [])
    # Captured in a graph, Adam keeps its step count on the device and reads its learning rate
    # from a tensor, which the schedule then sets in place.
    groups = [{"params": [t for gp in params.values() for t in gp.grid_params()]}]
    if codes:
        groups.append({"params": [gp.c for gp in params.values()]})
    for g, lr0 in zip(groups, base_lrs, strict=True):
        g["lr"] = torch.tensor(lr0, device=dev) if graphed else lr0
    opt = torch.optim.Adam(groups, capturable=graphed)

    def decay(step: int, elapsed: float) -> None:
        """Cosine decay to 0 at `steps`, or at the time limit if that comes first (so a run
        stopped by the clock has decayed too, however fast the device is)."""
        done = step / max(steps, 1)
        if time_limit_s is not None:
            done = max(done, elapsed / time_limit_s) if time_limit_s > 0 else 1.0
        f = 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        for g, lr0 in zip(opt.param_groups, base_lrs, strict=True):
            if graphed:
                g["lr"].fill_(lr0 * f)
            else:
                g["lr"] = lr0 * f
        report.lr_factor = f

    cs = cos_sin_table(cfg, n, dev)
    d = cfg.head_dim

    def rope(k: int):
        return cs[:, None, : d // 2].repeat(k, 1, 1), cs[:, None, d // 2 :].repeat(k, 1, 1)

    @torch.no_grad()
    def teacher_logp(ids: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(forward_logits(teacher, cfg, ids, *rope(len(ids))), -1)

    def student_logits(ids: torch.Tensor) -> torch.Tensor:
        w = dict(fixed)
        for k, gp in params.items():
            w[k] = gp.weight()
        return forward_logits(w, cfg, ids, *rope(len(ids)))

    def kl(logits: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, -1)
        return F.kl_div(logp, t_logp, log_target=True, reduction="sum") / logits.shape[0]

    # The teacher's log-probabilities of the held-out sequences, once; of the training batches,
    # as they are drawn (the float model costs a third of a training step).
    val_t = [teacher_logp(val[i : i + batch]) for i in range(0, len(val), batch)]

    @torch.no_grad()
    def val_kl() -> float:
        total = 0.0
        for j, i in enumerate(range(0, len(val), batch)):
            ids = val[i : i + batch]
            total += float(kl(student_logits(ids), val_t[j])) * ids.numel()
        return total / val.numel()

    def state() -> list[torch.Tensor]:
        return [t.detach().clone() for gp in params.values() for t in gp.params()]

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        return kl(student_logits(ids), teacher_logp(ids))

    def update(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()

    graph = static_ids = static_loss = side = None
    if graphed:
        static_ids = torch.empty((batch, n), dtype=calib.dtype, device=dev)
        side = torch.cuda.Stream(dev)

    def train_step(step: int, ids: torch.Tensor) -> torch.Tensor:
        """Step `step` (from 1) on `ids`; its loss (a device tensor, not synchronised)."""
        nonlocal graph, static_loss
        if not graphed:
            loss = loss_of(ids)
            opt.zero_grad(set_to_none=True)
            update(loss)
            return loss.detach()  # (the step's autograd graph is not kept alive into the next)
        static_ids.copy_(ids)
        if step <= _GRAPH_WARMUP_STEPS:
            # Eager on a side stream first (as torch.cuda.graphs asks): lazy initialisation of
            # cuBLAS, autograd and Adam's state must not happen inside the capture.
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                loss = loss_of(static_ids)
                opt.zero_grad(set_to_none=True)
                update(loss)
            torch.cuda.current_stream(dev).wait_stream(side)
            return loss.detach()
        if graph is None:
            # Gradients start from None in the capture, so the replayed backward writes them
            # (never accumulates); a capture runs nothing, so the replay below is this step.
            graph = torch.cuda.CUDAGraph()
            opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                static_loss = loss_of(static_ids)
                update(static_loss)
            static_loss = static_loss.detach()
        graph.replay()
        return static_loss

    report = E2EReport(train_seqs=len(train), val_seqs=len(val))
    report.start_kl = report.best_kl = val_kl()
    report.history.append((0, report.start_kl))
    best = state()
    if log is not None:
        log(f"e2e: held-out KL at start {report.start_kl:.5f} ({len(train)} training sequences)")
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train), generator=gen)
    pos = 0
    for step in range(1, steps + 1):
        if pos + batch > len(train):
            order, pos = torch.randperm(len(train), generator=gen), 0
        ids = train[order[pos : pos + batch]]
        pos += batch
        loss = train_step(step, ids)
        if graphed:
            torch.cuda.current_stream(dev).synchronize()  # the clock below counts finished steps
        elapsed = time.monotonic() - t_start
        if cosine:
            decay(step, elapsed)
        late = time_limit_s is not None and elapsed > time_limit_s
        if step % eval_every == 0 or step == steps or late:
            v = val_kl()
            report.history.append((step, v))
            if log is not None:
                log(
                    f"e2e: step {step}: training KL {float(loss.detach()):.5f}, held-out KL {v:.5f} "
                    f"({time.monotonic() - t_start:.0f}s)"
                )
            if v < report.best_kl:
                report.best_kl, report.best_step, best = v, step, state()
            if late:
                report.stopped_at = step
                if log is not None:
                    log(f"e2e: time limit of {time_limit_s:.0f}s reached at step {step}")
                break
    with torch.no_grad():
        flat = [t for gp in params.values() for t in gp.params()]
        for t, b in zip(flat, best, strict=True):
            t.copy_(b)
    out = dict(quantized)
    for k, gp in params.items():
        out[k] = gp.packed().to(quantized[k].device) if report.best_step else quantized[k]
    report.seconds = round(time.monotonic() - t_start, 1)
    return out, report
