"""The cases of ``bench/gpu_step`` as data, and the shapes they run at."""

import dataclasses

SHAPES = {  # name -> (LlamaConfig kwargs, batch, seq, which cases)
    "1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True), 4, 2048, "all"),
    "8b": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False), 2, 2048, "lora"),
    # a smoke shape for the CPU check of the case code (NXD_HF_BENCH_ALLOW_CPU=1), not a benchmark
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True), 2, 32, "all"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    runner: str  # "hf_loop", "hf_trainer", "nxd_loop", "nxd_trainer"
    compile: bool = False
    liger: bool = False
    fused_loss: bool = False
    lora: str | None = None  # adapter dtype: "fp32" (peft's default) or "bf16"

    @property
    def name(self) -> str:
        parts = [self.runner] + (["lora_" + self.lora] if self.lora else []) + (["liger"] if self.liger else [])
        return "+".join(parts + (["fused_loss"] if self.fused_loss else []) + (["compile"] if self.compile else []))


def all_cases() -> list[Case]:
    cases = []
    for compile_ in (False, True):
        cases += [Case(runner="hf_loop", compile=compile_), Case(runner="hf_loop", liger=True, compile=compile_),
                  Case(runner="hf_trainer", compile=compile_)]
        cases += [Case(runner="hf_loop", lora=dtype, compile=compile_) for dtype in ("fp32", "bf16")]
        for fused in (False, True):
            cases += [Case(runner="nxd_loop", fused_loss=fused, compile=compile_),
                      Case(runner="nxd_trainer", fused_loss=fused, compile=compile_)]
            cases += [Case(runner="nxd_loop", lora=dtype, fused_loss=fused, compile=compile_) for dtype in ("fp32", "bf16")]
        # Liger's kernels inside nxd_hf's layers, with nxd_hf's fused loss (Liger's own loss is full-vocabulary)
        cases += [Case(runner=runner, liger=True, fused_loss=True, compile=compile_) for runner in ("nxd_loop", "nxd_trainer")]
    return cases


def cases_for(which: str) -> list[Case]:
    return [c for c in all_cases() if which == "all" or (c.lora and c.runner.endswith("loop"))]
