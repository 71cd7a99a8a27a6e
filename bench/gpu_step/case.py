"""One case of ``bench/gpu_step`` in this process: build the model on the device, train
``warmup + steps`` steps, time each (synchronized), and return tokens/s, MFU and peak memory."""

import os
import statistics
import time

import torch

from bench.gpu_step.cases import SHAPES, Case

PEAK_FLOPS = 989e12  # H100 SXM dense bf16
LR = 1e-5
MAX_GRAD_NORM = 1.0  # Trainer's default: the loops clip as Trainer does, or nxd_hf's clipping would go unmeasured


def flops_per_token(config, seq: int) -> float:
    """6N (N: the parameters but the input embedding, as PaLM) + attention's 12 L h s."""
    h, inter, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * h // config.num_attention_heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter
    return 6 * (layers * per_layer + vocab * h) + 12 * layers * h * seq


def _init_single_process() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def _model(case: Case, config, device, dtype):
    import transformers

    if case.liger and case.runner.startswith("hf"):  # nxd_hf applies Liger's kernels itself, after parallelize
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # optional: pip install liger-kernel

        apply_liger_kernel_to_llama()
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return model


def _lora_config():
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")


def _build(case: Case, config, device):
    """(model to train, parameters to optimize)."""
    import peft

    import nxd_hf

    trainer_fp32 = case.runner.endswith("trainer")  # Trainer: fp32 weights, bf16=True autocast
    model = _model(case, config, device, torch.float32 if trainer_fp32 else torch.bfloat16)
    autocast = case.lora == "fp32"
    if case.runner == "nxd_loop":
        _init_single_process()
        model = nxd_hf.parallelize(model, tensor_parallel_size=1, fused_loss=case.fused_loss, device=device,
                                   lora_config=_lora_config() if case.lora else None, autocast_adapter_dtype=autocast)
        if case.liger:
            from nxd_hf.model_setup.liger import apply_liger_kernels

            apply_liger_kernels(model)
    elif case.lora:
        model = peft.get_peft_model(model, _lora_config(), autocast_adapter_dtype=autocast)
    if case.compile and not case.runner.endswith("trainer"):
        model.compile()
    return model


def _loop(model, batches, steps: list, clip) -> None:
    """Trainer's step as a loop: forward, backward, clipping at ``MAX_GRAD_NORM`` (plain HF with
    torch's ``clip_grad_norm_``, nxd_hf with its own, which knows the shards), AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, fused=params[0].is_cuda)
    for ids in batches:
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync()
        steps.append(time.perf_counter() - start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _trainer(case: Case, model, batches, steps: list, out_dir: str) -> None:
    import transformers

    import nxd_hf

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            _sync()
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            _sync()
            steps.append(time.perf_counter() - self.start)

    common = dict(output_dir=out_dir, per_device_train_batch_size=batches[0].shape[0], max_steps=len(batches),
                  learning_rate=LR, bf16=torch.cuda.is_available(), report_to=[], save_strategy="no", logging_strategy="no",
                  torch_compile=case.compile, dataloader_num_workers=0)
    data = [{"input_ids": row, "labels": row} for ids in batches for row in ids.cpu()]
    if case.runner == "nxd_trainer":
        _init_single_process()
        args = nxd_hf.NxDTrainingArguments(tensor_parallel_size=1, fused_loss=case.fused_loss,
                                           use_liger_kernel=case.liger, **common)
        trainer = nxd_hf.NxDTrainer(model, args, train_dataset=data, callbacks=[Timer()])
    else:
        args = transformers.TrainingArguments(**common)
        trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[Timer()])
    trainer.train()


def run_case(case: Case, shape: str, warmup: int, steps: int, out_dir: str) -> dict:
    import transformers

    kwargs, batch, seq, _ = SHAPES[shape]
    config = transformers.LlamaConfig(**kwargs, max_position_embeddings=seq)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device) for _ in range(warmup + steps)]
    model = _build(case, config, device)
    times: list = []
    if case.runner.endswith("trainer"):
        _trainer(case, model, batches, times, out_dir)
    else:
        from nxd_hf.parallel_layers import clip_grad_norm

        _loop(model, batches, times, clip_grad_norm if case.runner == "nxd_loop" else torch.nn.utils.clip_grad_norm_)
    timed = times[warmup:]
    median = statistics.median(timed)
    tokens_per_s = batch * seq / median
    result = {"case": case.name, "tokens_per_s": tokens_per_s,
              "spread": (max(timed) - min(timed)) / median, "step_s_median": median,
              "mfu": None if case.lora else tokens_per_s * flops_per_token(config, seq) / PEAK_FLOPS}
    if torch.cuda.is_available():
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result
