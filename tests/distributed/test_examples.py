"""The examples end to end: a job spanning two torchrun agents (two "nodes" on localhost) resumed
by the README's main job under torchrun, and the README's first screen matching
what CI runs; the other examples and every command of their docstrings (capped steps) run as
their scripts on the ranks of a pool (``run_on_ranks``: what torchrun starts, less the launch,
which the torchrun tests here and in test_lightning.py cover)."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import transformers

from support.paths import REPO
from support.scripts import loss_fell, run_on_ranks

ROOT = str(REPO)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _check(result) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def run_example(script: str, nproc: int, *args: str) -> str:
    command = [*TORCHRUN, "--nproc_per_node", str(nproc), script, *args]
    return _check(subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600))


def run_one_process(script: str, *args: str) -> str:
    """``python script.py``: a world of one (on the GPU under nccl), as a user runs it without torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NXD_HF_BACKEND")}
    return _check(subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=600, env=env))


def logged(output_dir) -> dict[str, list[tuple[int, float]]]:
    """The (step, value) of every logged loss and grad_norm in the trainer_state.json a Trainer example writes."""
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    return {key: [(h["step"], h[key]) for h in history if key in h] for key in ("loss", "grad_norm")}


def check_matches_one_process(script: str, nproc: int, args: list[str], one_process_args: list[str], tmp_path,
                              **tol) -> None:
    """``script`` on ``nproc`` ranks logs, step by step, the losses and grad norms of its one-process run."""
    run_example(script, nproc, *args, "--logging_steps", "1", "--output_dir", str(tmp_path / "ranks"))
    run_one_process(script, *one_process_args, "--logging_steps", "1", "--output_dir", str(tmp_path / "one"))
    ours, reference = logged(tmp_path / "ranks"), logged(tmp_path / "one")
    for key, want in reference.items():
        got = ours[key]
        assert [s for s, _ in got] == [s for s, _ in want] and want, (key, got, want)
        torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]),
                                   **(tol or dict(rtol=1e-4, atol=1e-5)), msg=lambda m: f"{script} {args} {key}: {m}")


def check_lightning_matches_one_process(args: list[str], one_process_args: list[str], tmp_path) -> None:
    """examples/lightning_causal_lm.py on two ranks prints the first and last loss and the val_loss of
    its one-process run (printed with 4 decimals: compared to within their rounding)."""
    script = "examples/lightning_causal_lm.py"
    outs = [run_example(script, 2, *args, "--output-dir", str(tmp_path / "ranks")),
            run_one_process(script, *one_process_args, "--output-dir", str(tmp_path / "one"))]
    pattern = r"val_loss ([\d.]+); loss fell from ([\d.]+) to ([\d.]+)"
    ours, reference = (torch.tensor([float(v) for v in re.search(pattern, out).groups()]) for out in outs)
    torch.testing.assert_close(ours, reference, rtol=0, atol=2e-4, msg=lambda m: f"{args}: {m}\n{outs}")


def test_finetune_causal_lm_pp2_zero1_lora(rank_pools, tmp_path):
    """pp=2; then LoRA with ZeRO-1 over dp=2 (adapters' state sharded); the adapter is saved."""
    loss_fell(run_on_ranks(rank_pools, "examples/finetune_causal_lm.py", 2, "--pp", "2", "--max_steps", "12",
                            "--logging_steps", "4", "--output_dir", str(tmp_path / "pp")))
    out = run_on_ranks(rank_pools, "examples/finetune_causal_lm.py", 2, "--lora", "--zero1", "--tp", "1",
                       "--max_steps", "12", "--logging_steps", "4", "--learning_rate", "1e-2",
                       "--output_dir", str(tmp_path / "lora"))
    loss_fell(out)
    assert os.path.exists(tmp_path / "lora" / "final" / "adapter_model.safetensors"), out


def test_classify_bert_accuracy(rank_pools, tmp_path):
    out = run_on_ranks(rank_pools, "examples/classify_bert.py", 2, "--max_steps", "40", "--output_dir", str(tmp_path))
    before, after = map(float, re.search(r"accuracy on them went from ([\d.]+) to ([\d.]+)", out).groups())
    assert after > before, out
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    assert model.config.num_labels == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_then_the_readme_job_resumes_and_loads_in_transformers(no_rank_pool, tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on localhost, one process each) train with
    tp=2 spanning them and save checkpoint-10; then the README's main job (one node, two processes)
    resumes it to step 30: the loss falls and the saved model opens in transformers."""
    job = ["examples/finetune_causal_lm.py", "--output_dir", str(tmp_path), "--save_strategy", "steps",
           "--save_steps", "10"]
    agent = [*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "nxd_hf_test",
             "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", *job, "--tp", "2", "--max_steps", "10"]
    agents = [subprocess.Popen(agent, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outs = [agent.communicate(timeout=600) for agent in agents]
    for agent, (stdout, stderr) in zip(agents, outs):
        assert agent.returncode == 0, stdout[-3000:] + stderr[-3000:]
    two_nodes = "".join(stdout for stdout, _ in outs)
    assert "steps 10..10 on 2 tp x 1 pp x 1 dp" in two_nodes, two_nodes
    assert os.path.isdir(tmp_path / "checkpoint-10")
    resumed = run_example(*job[:1], 2, *job[1:], "--max_steps", "30", "--resume_from_checkpoint", "true")
    assert f"resuming from {tmp_path / 'checkpoint-10'}" in resumed, resumed
    assert "steps 10..30 on 2 tp x 1 pp x 1 dp" in resumed, resumed  # step 10's log comes with the state
    first, last = loss_fell(resumed)
    assert last < first - 0.5, resumed
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 301)


def test_readme_first_screen_is_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    first_screen = readme.split("\n## ", 1)[0]
    assert "make train" in first_screen and "make test" in first_screen, first_screen
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert "examples/finetune_causal_lm.py" in makefile.split("train:", 1)[1].split("\n\n")[0]
    assert "-m pytest tests -q" in makefile.split("test:", 1)[1]
    assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_parallelize_causal_lm_loss_falls(rank_pools):
    first, last = loss_fell(run_on_ranks(rank_pools, "examples/parallelize_causal_lm.py", 2, "--steps", "25"))
    assert last < first - 1.0


def test_train_with_config_api_pp2_zero1_loss_falls(rank_pools, tmp_path):
    """Then a second job resumes from the asynchronous checkpoint the first saved at exit, at
    other parallel sizes (tp 2 x dp 2), and keeps training."""
    ckpt = str(tmp_path / "ckpt")
    out = run_on_ranks(rank_pools, "examples/train_with_config_api.py", 4, "--pp", "2", "--zero1", "--steps", "12",
                      "--checkpoint-dir", ckpt, "--save-every", "6")
    assert "tp 1 x pp 2 x dp 2, zero1=True" in out, out
    first, last = loss_fell(out)
    assert last < first - 1.0, out
    assert sorted(os.listdir(ckpt)) == ["checkpoints.json", "owner.json", "step12", "step6"]
    resumed = run_on_ranks(rank_pools, "examples/train_with_config_api.py", 4, "--tp", "2", "--zero1", "--steps", "16",
                          "--checkpoint-dir", ckpt, "--save-every", "6")
    assert "resumed from step 12" in resumed, resumed
    after = float(re.search(r"step  12  loss ([\d.]+)", resumed).group(1))  # no restart from scratch
    assert after < first - 1.0, resumed


# -- every command of the examples' docstrings runs to the end (capped to a few steps)
COVERED = {  # docstring command (as written, comment dropped) -> the test that runs it already
    "torchrun --nproc_per_node 2 examples/finetune_causal_lm.py":
        "test_two_nodes_then_the_readme_job_resumes_and_loads_in_transformers",
    "torchrun --nproc_per_node 2 examples/finetune_causal_lm.py --pp 2": "test_finetune_causal_lm_pp2_zero1_lora",
    "torchrun --nproc_per_node 2 examples/finetune_causal_lm.py --resume_from_checkpoint true":
        "test_two_nodes_then_the_readme_job_resumes_and_loads_in_transformers",
    "torchrun --nproc_per_node 2 examples/parallelize_causal_lm.py": "test_parallelize_causal_lm_loss_falls",
    # DIR and FILE filled with the bundled model and text are the scripts' defaults: the runs above
    "torchrun --nproc_per_node 2 examples/finetune_causal_lm.py --model DIR --data FILE":
        "test_two_nodes_then_the_readme_job_resumes_and_loads_in_transformers",
    "torchrun --nproc_per_node 2 examples/parallelize_causal_lm.py --model DIR": "test_parallelize_causal_lm_loss_falls",
    "torchrun --nproc_per_node 4 examples/train_with_config_api.py --pp 2 --zero1":
        "test_train_with_config_api_pp2_zero1_loss_falls",
    "torchrun --nproc_per_node 2 examples/sft_trl.py --tensor_parallel_size 2 --lora": "test_trl.py",
    # the LoRA command: test_dpo.py runs the script; the other two layouts: its parity cases
    "torchrun --nproc_per_node 2 examples/dpo_trl.py --tensor_parallel_size 2 --lora": "test_dpo.py",
    "torchrun --nproc_per_node 2 examples/dpo_trl.py --tensor_parallel_size 2": "test_dpo.py",
    "torchrun --nproc_per_node 2 examples/dpo_trl.py --zero_1 true": "test_dpo.py",
    # the LoRA command: test_reward.py runs the script; the other layout: its parity cases
    "torchrun --nproc_per_node 2 examples/reward_trl.py --tensor_parallel_size 2 --lora": "test_reward.py",
    "torchrun --nproc_per_node 2 examples/reward_trl.py --zero_1 true": "test_reward.py",
    "torchrun --nproc_per_node 2 examples/lightning_causal_lm.py --tp 2": "test_lightning.py (under torchrun)",
    "torchrun --nproc_per_node 2 examples/lightning_causal_lm.py --zero1 --resume lightning_out/last.ckpt":
        "test_lightning.py (under torchrun)",
    "torchrun --nproc_per_node 4 examples/nnscaler_example.py --example 1 --policy tp --plan_ngpus 2 --use_zero":
        "test_nnscaler_state.py",
    "torchrun --nproc_per_node 4 examples/nnscaler_example.py --example 3 --policy tp --plan_ngpus 2":
        "test_nnscaler_state.py",
}
CAPPED = {  # script -> what is appended to each of its commands: a few steps, output under the test's directory
    "classify_bert.py": ["--max_steps", "4", "--output_dir", "{out}"],
    "dpo_trl.py": ["--max_steps", "4", "--output_dir", "{out}"],
    "finetune_causal_lm.py": ["--max_steps", "4", "--output_dir", "{out}"],
    "lightning_causal_lm.py": ["--max-steps", "4", "--output-dir", "{out}"],
    "lightning_own_module.py": ["--max-steps", "4", "--output-dir", "{out}"],
    "make_tiny_model.py": [],  # [--out DIR] is given: the default would rewrite the bundled model
    "nnscaler_example.py": ["--steps", "4", "--gen_savedir", "{out}"],
    "parallelize_causal_lm.py": ["--steps", "4"],
    "reward_trl.py": ["--max_steps", "4", "--output_dir", "{out}"],
    "sft_trl.py": ["--max_steps", "4", "--output_dir", "{out}"],
    "train_with_config_api.py": ["--steps", "4"],
}
FILLED = {  # a docstring's placeholder -> what a user would type (per script where it differs)
    "DIR": {"classify_bert.py": "{first}/final", "make_tiny_model.py": "{out}/tiny", "": "examples/data/tiny-llama"},
    "FILE": {"": "examples/data/tiny_corpus.txt"},
    "OUT": {"": "{first}"},
}
"""``{out}``: the command's own output directory; ``{first}``: the script's first command's."""


def docstring_commands(script: str) -> list[str]:
    """The commands in ``examples/<script>``'s docstring (comments dropped, ``[optional]`` parts given)."""
    import ast

    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "examples", script)).read())) or ""
    lines = [re.sub(r"\[(.*?)\]", r"\1", line.split("#")[0]).strip() for line in doc.splitlines()]
    return [" ".join(line.split()) for line in lines if line.startswith(("torchrun ", "python "))]


def _filled(word: str, script: str, dirs: dict) -> str:
    def fill(match):
        choices = FILLED.get(match.group(0))
        assert choices is not None, f"{script}: add what a user types for {match.group(0)} to FILLED"
        return choices.get(script, choices[""]).format(**dirs)

    return re.sub(r"\b[A-Z]{3,}\b", fill, word)


def _argv(command: str, script: str, dirs: dict) -> list[str]:
    words = [_filled(w, script, dirs) for w in command.split()]
    launcher = TORCHRUN if words[0] == "torchrun" else [sys.executable]
    return [*launcher, *words[1:], *(w.format(**dirs) for w in CAPPED[script])]


EXAMPLE_SCRIPTS = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


@pytest.mark.parametrize("script", EXAMPLE_SCRIPTS)
def test_docstring_commands_run_to_the_end(rank_pools, script, tmp_path):
    """Each command of the script's docstring, in order (a later one may use an earlier one's
    output), capped to a few steps, runs to the end (a ``torchrun`` command on the pool's ranks, a
    ``python`` one as a process); commands another test runs are skipped."""
    assert script in CAPPED, f"add how to cap {script}'s commands to CAPPED"
    commands = docstring_commands(script)
    assert commands or script == "__init__.py", f"{script} documents no command"
    for i, command in enumerate(commands):
        if command in COVERED:
            continue
        argv = _argv(command, script, {"out": str(tmp_path / str(i)), "first": str(tmp_path / "0")})
        if argv[:len(TORCHRUN)] == TORCHRUN:
            assert argv[len(TORCHRUN)] == "--nproc_per_node", command
            run_on_ranks(rank_pools, argv[len(TORCHRUN) + 2], int(argv[len(TORCHRUN) + 1]), *argv[len(TORCHRUN) + 3:])
            continue
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, f"{command}\n" + result.stdout[-3000:] + result.stderr[-3000:]
