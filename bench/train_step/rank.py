"""One process of ``bench/train_step/run.py``: build one case's model, train it, time the steps and
read the peak resident set; writes ``rank{r}.json`` into the result directory.

Only the standard library is imported at module level: the "bare" reading is a process with
torch, transformers (``Trainer`` included), accelerate and nxd_hf imported and, for the 2-rank
cases, the gloo process group up — the same imports in every case."""

import json
import os
import resource
import time

from bench.train_step.memtrace import MemTrace

TRACE = MemTrace()  # started by ``worker``; the cases mark their phases on it

MODEL = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048,
             vocab_size=32000)  # the ~125M llama of bench/; the layer count is a flag
LR, MAX_NORM = 5e-5, 1.0  # Trainer's defaults, used by the bare loops too


def read_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def reset_peak() -> int:
    """Set VmHWM to VmRSS; returns the peak before (the setup's)."""
    before = read_status()["VmHWM"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return before


def llama_config(num_layers: int, seq: int):
    import transformers

    return transformers.LlamaConfig(**MODEL, num_hidden_layers=num_layers, max_position_embeddings=seq)


def token_rows(num_rows: int, seq: int):
    """Random token sequences, the same on every rank and in every case."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(MODEL["vocab_size"], (num_rows, seq), generator=g)


class TokenDataset:
    """``input_ids`` = ``labels`` = one random row (a map-style dataset for ``Trainer``)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def plain_model(num_layers: int, seq: int):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(num_layers, seq))


def step_timer():
    """A ``TrainerCallback`` timing on_step_begin -> on_step_end (the data fetch before it and the
    logging after it excluded; wall and process CPU seconds), and on_step_end -> on_step_end (both
    included)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.cpu_seconds, self.intervals = [], [], []
            self._begin, self._begin_cpu, self._end = None, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            TRACE.mark("forward")
            self._begin, self._begin_cpu = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            TRACE.mark("optimizer")  # NxDOptimizer.step: DP reduction, clipping, the step

        def on_optimizer_step(self, args, state, control, **kwargs):
            TRACE.mark("zero_grad")  # Trainer: scheduler, zero_grad, callbacks

        def on_step_end(self, args, state, control, **kwargs):
            TRACE.mark("step_end")
            now = time.perf_counter()
            self.cpu_seconds.append(time.process_time() - self._begin_cpu)
            self.seconds.append(now - self._begin)
            if self._end is not None:
                self.intervals.append(now - self._end)
            self._end = now

    return StepTimer()


def trainer_args(cls, out_dir: str, steps: int, batch: int, **extra):
    return cls(output_dir=out_dir, per_device_train_batch_size=batch, max_steps=steps, save_strategy="no",
               report_to=[], logging_steps=steps, disable_tqdm=True, optim="adamw_torch", learning_rate=LR,
               max_grad_norm=MAX_NORM, lr_scheduler_type="constant", dataloader_num_workers=0,
               train_sampling_strategy="sequential", **extra)  # sequential: the bare loops' order


def run_trainer(trainer, timer) -> dict:
    """``trainer.train()`` with the peak reset after setup (the model is already built)."""
    setup_peak = reset_peak()
    trainer.model.register_forward_hook(lambda *_: TRACE.mark("backward"))  # loss computed
    output = trainer.train()
    return dict(seconds=timer.seconds, cpu_seconds=timer.cpu_seconds, intervals=timer.intervals,
                mean_loss=output.training_loss, setup_peak_rss=setup_peak)


def run_bare_loop(model, rows, *, steps: int, batch: int, clip, make_optimizer=None) -> dict:
    """AdamW (or ``make_optimizer(params)``), forward, backward, ``clip(params)``, step, zero_grad;
    the peak reset before the optimizer is built."""
    import torch

    setup_peak = reset_peak()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = (make_optimizer or (lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0)))(params)
    model.train()
    seconds, cpu_seconds, losses = [], [], []
    for step in range(steps):
        ids = rows[step * batch:(step + 1) * batch]
        start, start_cpu = time.perf_counter(), time.process_time()
        TRACE.mark("forward")
        loss = model(input_ids=ids, labels=ids).loss
        TRACE.mark("backward")
        loss.backward()
        TRACE.mark("clip")
        clip(params)
        TRACE.mark("optimizer")
        optimizer.step()
        TRACE.mark("zero_grad")
        optimizer.zero_grad(set_to_none=True)
        TRACE.mark("step_end")
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - start_cpu)
        losses.append(loss.item())
    return dict(seconds=seconds, cpu_seconds=cpu_seconds, intervals=[], mean_loss=sum(losses) / len(losses),
                setup_peak_rss=setup_peak)


def case_nxd_trainer(opts: dict, rows, out_dir: str, **layout) -> dict:
    """NxDTrainer at tp=2 (or ``layout``: NxDTrainingArguments fields)."""
    import nxd_hf

    timer = step_timer()
    args = trainer_args(nxd_hf.NxDTrainingArguments, out_dir, opts["steps"], opts["batch"],
                        **(layout or dict(tensor_parallel_size=2)))
    trainer = nxd_hf.NxDTrainer(plain_model(opts["layers"], opts["seq"]), args, train_dataset=TokenDataset(rows),
                                callbacks=[timer])
    return run_trainer(trainer, timer)


def case_nxd_loop(opts: dict, rows, out_dir: str) -> dict:
    import nxd_hf
    from nxd_hf.parallel_layers.grads import clip_grad_norm

    model = nxd_hf.parallelize(plain_model(opts["layers"], opts["seq"]), tensor_parallel_size=2)
    return run_bare_loop(model, rows, steps=opts["steps"], batch=opts["batch"],
                         clip=lambda params: clip_grad_norm(params, MAX_NORM))


def case_nxd_loop_tp1(opts: dict, rows, out_dir: str) -> dict:
    import nxd_hf
    from nxd_hf.parallel_layers.grads import clip_grad_norm

    model = nxd_hf.parallelize(plain_model(opts["layers"], opts["seq"]), tensor_parallel_size=1)
    return run_bare_loop(model, rows, steps=opts["steps"], batch=opts["batch"],
                         clip=lambda params: clip_grad_norm(params, MAX_NORM))


def case_overlap(opts: dict, rows, out_dir: str, tp: int) -> dict:
    """The bare loop at tp x dp (dp = world / tp) on ``opts["overlap_layers"]`` layers, the
    gradient reduction's overlap switched on and off every other step (interleaved in one run);
    each rank takes its own rows."""
    import torch.distributed as dist

    import nxd_hf
    from nxd_hf.parallel_layers.grads import clip_grad_norm

    model = nxd_hf.parallelize(plain_model(opts["overlap_layers"], opts["seq"]), tensor_parallel_size=tp)
    policy, dp_rank = model.nxd.grad_reduction, nxd_hf.parallel_state.get_data_parallel_rank()
    switch = []

    def clip(params):
        switch.append(policy.overlap)
        policy.overlap = not policy.overlap  # the next step runs the other way
        clip_grad_norm(params, MAX_NORM)

    own_rows = rows.roll(dp_rank * opts["batch"], dims=0)
    result = run_bare_loop(model, own_rows, steps=opts["steps"], batch=opts["batch"], clip=clip)
    dist.barrier()
    return dict(result, overlap=switch, num_buckets=len(policy.buckets.buckets))


def case_overlap_zero1(opts: dict, rows, out_dir: str, tp: int) -> dict:
    """``case_overlap`` with ZeRO-1 (``NeuronZero1Optimizer``, AdamW, clipping in its step): its
    reduce-scatter started per bucket during backward, or all in ``step()``, every other step."""
    import torch
    import torch.distributed as dist

    import nxd_hf
    from nxd_hf.optim import NeuronZero1Optimizer

    model = nxd_hf.parallelize(plain_model(opts["overlap_layers"], opts["seq"]), tensor_parallel_size=tp)
    dp_rank, switch, made = nxd_hf.parallel_state.get_data_parallel_rank(), [], []

    def make_optimizer(params):
        made.append(NeuronZero1Optimizer(params, torch.optim.AdamW, lr=LR, weight_decay=0.0, max_norm=MAX_NORM))
        return made[0]

    def clip(params):  # ZeRO-1 clips in step(); only the switch here, for the step after this one
        switch.append(made[0].overlap_reduce_scatter)
        made[0].overlap_reduce_scatter = not made[0].overlap_reduce_scatter

    own_rows = rows.roll(dp_rank * opts["batch"], dims=0)
    result = run_bare_loop(model, own_rows, steps=opts["steps"], batch=opts["batch"], clip=clip,
                           make_optimizer=make_optimizer)
    dist.barrier()
    return dict(result, overlap=switch, num_buckets=sum(len(fg.buckets()) for fg in made[0].flat_groups))


def case_hf_tp(opts: dict, rows, out_dir: str) -> dict:
    """transformers' own TP (``DistributedConfig(tp_size=2)``, which only ``from_pretrained``
    takes), trained by ``transformers.Trainer`` where it can be built (``use_cpu=True``, as on a
    CPU under torchrun), else — or with ``opts["hf_tp_loop"]`` — by the bare loop, clipping as
    ``Trainer`` does on mixed meshes (``clip_mixed_mesh``)."""
    import torch
    import transformers
    from transformers.distributed import DistributedConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        opts["checkpoint"], dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2))
    refused = "--hf-tp-loop"
    if not opts.get("hf_tp_loop"):
        timer = step_timer()
        args = trainer_args(transformers.TrainingArguments, out_dir, opts["steps"], opts["batch"], use_cpu=True)
        try:
            trainer = transformers.Trainer(model, args, train_dataset=TokenDataset(rows), callbacks=[timer])
            return dict(run_trainer(trainer, timer), trained_by="transformers.Trainer")
        except ValueError as e:  # accelerate refuses its ParallelismConfig on CPU (MULTI_CPU)
            refused = f"transformers.Trainer refused: {e}"
    result = run_bare_loop(model, rows, steps=opts["steps"], batch=opts["batch"], clip=clip_mixed_mesh)
    return dict(result, trained_by="bare loop", trainer_refused=refused)


def clip_mixed_mesh(params) -> None:
    """``Trainer._mixed_mesh_grad_norm``: transformers' TP leaves the norms plain tensors, which
    ``clip_grad_norm_`` cannot mix with DTensors: one norm per mesh, combined, then clip."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    by_mesh = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for group in by_mesh.values():
        clip_grads_with_norm_(group, MAX_NORM, total)


def case_deepspeed_autotp(opts: dict, rows, out_dir: str) -> dict:
    """DeepSpeed's AutoTP training (``tensor_parallel.autotp_size=2`` in the config; ZeRO stage 0,
    AdamW as torch's, clipping at 1.0) on the same model and rows, DS_ACCELERATOR=cpu, gloo; the
    engine's forward, ``backward`` and ``step``. DeepSpeed is not a dependency: ``run.py`` puts
    ``--deepspeed-path`` on the path of this case only and skips it when deepspeed does not import."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": opts["batch"], "gradient_accumulation_steps": 1,
              "gradient_clipping": MAX_NORM, "zero_optimization": {"stage": 0},
              "tensor_parallel": {"autotp_size": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    model = plain_model(opts["layers"], opts["seq"])
    setup_peak = reset_peak()
    full_numel = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()
    local_numel = sum(p.numel() for p in engine.module.parameters())  # AutoTP shards in initialize
    seconds, cpu_seconds, losses = [], [], []
    for step in range(opts["steps"]):
        ids = rows[step * opts["batch"]:(step + 1) * opts["batch"]]
        start, start_cpu = time.perf_counter(), time.process_time()
        TRACE.mark("forward")
        loss = engine(input_ids=ids, labels=ids).loss
        TRACE.mark("backward")
        engine.backward(loss)
        TRACE.mark("optimizer")
        engine.step()
        TRACE.mark("step_end")
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - start_cpu)
        losses.append(loss.item())
    return dict(seconds=seconds, cpu_seconds=cpu_seconds, intervals=[], mean_loss=sum(losses) / len(losses),
                setup_peak_rss=setup_peak, trained_by=f"deepspeed {deepspeed.__version__} engine",
                local_param_fraction=local_numel / full_numel)


def case_single(opts: dict, rows, out_dir: str) -> dict:
    import torch

    return run_bare_loop(plain_model(opts["layers"], opts["seq"]), rows, steps=opts["steps"], batch=opts["batch"],
                         clip=lambda params: torch.nn.utils.clip_grad_norm_(params, MAX_NORM))


CASES = {"nxd_trainer": case_nxd_trainer, "nxd_loop": case_nxd_loop, "hf_tp": case_hf_tp, "single": case_single,
         "nxd_loop_tp1": case_nxd_loop_tp1, "nxd_zero1": lambda *a: case_nxd_trainer(*a, zero_1=True),  # tp=1 x dp=2
         "overlap_dp2": lambda *a: case_overlap(*a, tp=1), "overlap_tp2dp2": lambda *a: case_overlap(*a, tp=2),
         "overlap_zero1_dp2": lambda *a: case_overlap_zero1(*a, tp=1),
         "overlap_zero1_tp2dp2": lambda *a: case_overlap_zero1(*a, tp=2), "deepspeed_autotp": case_deepspeed_autotp}
ONE_PROCESS = ("single", "nxd_loop_tp1")


def worker(case: str, opts: dict, result_dir: str) -> None:
    import gc
    import tempfile
    import warnings

    import accelerate  # noqa: F401  the same imports in every case
    import torch
    import torch.distributed as dist
    import transformers
    import transformers.trainer  # noqa: F401

    import nxd_hf  # noqa: F401

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    distributed = case not in ONE_PROCESS
    torch.set_num_threads(int(os.environ.get("NXD_HF_BENCH_THREADS", 1 if distributed else 2)))
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    rows = token_rows(opts["batch"] * opts["steps"], opts["seq"])
    gc.collect()
    if distributed:
        dist.barrier()
    bare = read_status()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir, TRACE:
        result = CASES[case](opts, rows, out_dir)
    end = read_status()
    result.update(bare_anon=bare["RssAnon"], memtrace=TRACE.result())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result.update(rank=rank, case=case, bare_rss=bare["VmRSS"], rusage_cpu_seconds=usage.ru_utime + usage.ru_stime, train_peak_rss=end["VmHWM"],
                  end_rss=end["VmRSS"], end_anon=end["RssAnon"], end_file=end["RssFile"],
                  wall_seconds=time.perf_counter() - start, threads=torch.get_num_threads())
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
