"""One rank of ``bench/scaling/run.py`` (a ``torch.distributed.run`` worker): parallelize a tiny
llama as the point says, train ``warmup + steps`` steps with AdamW, and record the step times,
the peak RssAnon over the timed steps (a thread sampling every 2 ms), and the payload bytes this
rank handed to collectives in one step (``nxd_hf.backend.count_comm``)."""

import json
import os
import time

from bench.memory.rank import PeakSampler


def build(point: dict):
    import torch
    import transformers

    import nxd_hf

    config = transformers.LlamaConfig(
        hidden_size=point["hidden"], intermediate_size=point["hidden"] * 8 // 3 // 64 * 64 or 64,
        num_attention_heads=point["hidden"] // 64, num_key_value_heads=max(point["hidden"] // 128, 1),
        num_hidden_layers=point["layers"], vocab_size=point["vocab"], max_position_embeddings=point["seq"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    kwargs = dict(tensor_parallel_size=point["tp"], sequence_parallel=point["sp"],
                  activation_checkpoint_config="full" if point["ac"] else None)
    if point["pp"] > 1:
        kwargs.update(pipeline_parallel_size=point["pp"], num_microbatches=point["pp"])
    return nxd_hf.parallelize(model, **kwargs)


def worker(point: dict, result_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from nxd_hf import backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build(point)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(point["vocab"], (point["batch"], point["seq"]), generator=g)

    def step():
        if point["pp"] > 1:
            model.run_train(input_ids=ids, labels=ids)
        else:
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(point["warmup"]):
        step()
    with backend.count_comm() as records:
        step()
    seconds = []
    dist.barrier()
    with PeakSampler(interval_s=0.002) as peak:
        for _ in range(point["steps"]):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
    local_param_bytes = sum(p.numel() * p.element_size() for p in params)
    result = dict(rank=dist.get_rank(), seconds=seconds, peak_anon=peak.peak["RssAnon"],
                  comm_bytes=sum(r.payload_bytes for r in records), num_collectives=len(records),
                  local_param_bytes=local_param_bytes)
    with open(os.path.join(result_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
