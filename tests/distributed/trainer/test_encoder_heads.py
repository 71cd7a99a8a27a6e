"""BERT's heads as transformers' examples train them, against transformers.Trainer on one
process (losses and grad norms every step, final weights): BertForMaskedLM as run_mlm.py trains
it, DataCollatorForLanguageModeling masking a random 30% of the tokens (a different number in
every row), and BertForTokenClassification as run_ner.py does, on rows of different lengths
padded by DataCollatorForTokenClassification (also with LoRA, ``task_type="TOKEN_CLS"``, whose
head peft trains too), at tp=2, dp=2 and pp=2, and BertForQuestionAnswering on answer spans (as
run_qa.py's features) at tp=2 and dp=2. BERT's forward computes its loss inline
(``CrossEntropyLoss()``, the mean over its own labels), so at dp>1 each replica's loss is
weighted by its share of the labels (``nxd_hf.trainer.mean_loss``); before, the replicas' means
were averaged (the masked LM's step-1 loss off by 3e-5 relative, growing after)."""

import tempfile

import pytest
import torch
import transformers

import nxd_hf
from nxd_hf import parallel_state
from support import hf_parity
from test_nxd_trainer import COMMON, _check_training, one_process_reference_args


def _tokenizer(directory: str):
    """A WordPiece tokenizer over the tiny vocabulary, with BERT's special tokens ([MASK]: 4)."""
    words = [f"w{i}" for i in range(hf_parity.VOCAB - 5)]
    with open(f"{directory}/vocab.txt", "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return transformers.BertTokenizerFast(f"{directory}/vocab.txt")


def _rows(n: int, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": [2, *torch.randint(5, hf_parity.VOCAB, (10,), generator=g).tolist(), 3]} for _ in range(n)]


def _tagged_rows(n: int, seed: int = 4) -> list[dict]:
    """Rows of 4 to 10 tokens, each tagged with one of 3 labels."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(5, hf_parity.VOCAB, (4 + i % 7,), generator=g).tolist(),
             "labels": torch.randint(0, 3, (4 + i % 7,), generator=g).tolist()} for i in range(n)]


def _lora():
    import peft

    return peft.LoraConfig(task_type="TOKEN_CLS", r=4, lora_alpha=8, target_modules=["query", "value"],
                           lora_dropout=0.0)


def _spans(n: int, seed: int = 5) -> list[dict]:
    """Rows of 12 tokens with an answer span (start, end), as run_qa.py's features."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(5, hf_parity.VOCAB, (12,), generator=g), "start_positions": torch.tensor(i % 5),
             "end_positions": torch.tensor(5 + i % 6)} for i in range(n)]


def _run(out_dir: str, *, batch: int, samples: int = 24, accumulate: int = 1, tagging: bool = False,
         lora: bool = False, spans: bool = False, **layout):
    parallel_state.destroy_model_parallel()
    tokenizer = _tokenizer(out_dir)
    common = {**COMMON, "gradient_accumulation_steps": accumulate}
    if spans:
        reference, model = hf_parity.build_pair("bert", task_model_cls=transformers.BertForQuestionAnswering,
                                                num_labels=2)
        collator, data = transformers.default_data_collator, _spans(samples)
        # the start/end logits' bias has a zero gradient in exact arithmetic (a softmax over the
        # positions): AdamW at eps 1e-8 turns its rounding into whole updates on either side
        common["adam_epsilon"] = 1e-6
    elif tagging:
        reference, model = hf_parity.build_pair("bert", task_model_cls=transformers.BertForTokenClassification,
                                                num_labels=3)
        collator, data = transformers.DataCollatorForTokenClassification(tokenizer), _tagged_rows(samples)
    else:
        reference, model = hf_parity.build_pair("bert")
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
        data = _rows(samples)
    model_parallel = layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)
    dp = torch.distributed.get_world_size() // model_parallel
    if lora:  # peft's token-classification model also trains the head (modules_to_save)
        import peft

        torch.manual_seed(11)
        reference = peft.get_peft_model(reference, _lora())
    ref = transformers.Trainer(reference, one_process_reference_args(
        output_dir=f"{out_dir}/ref", per_device_train_batch_size=batch * dp, **common),
        train_dataset=data, data_collator=collator)
    ref.train()
    torch.manual_seed(11)
    ours = nxd_hf.NxDTrainer(model, nxd_hf.NxDTrainingArguments(
        output_dir=f"{out_dir}/nxd", per_device_train_batch_size=batch, **common, **layout),
        train_dataset=data, data_collator=collator, peft_config=_lora() if lora else None)
    ours.train()
    return ref, ours


def check_run_train_weights_the_replicas() -> None:
    """NxD's run_train on each replica's rows: the loss of the whole batch on one process."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("bert")
    ids = torch.randint(5, hf_parity.VOCAB, (4, 12), generator=torch.Generator().manual_seed(5))
    labels = torch.full_like(ids, -100)
    labels[0, :9], labels[1, 2], labels[2:, 5:7] = ids[0, :9], ids[1, 2], ids[2:, 5:7]  # 9 and 1 | 2 and 2 tokens
    want = reference(input_ids=ids, labels=labels).loss
    nxd_model = nxd_hf.initialize_parallel_model(nxd_hf.neuronx_distributed_config(), lambda: model)
    rows = slice(2 * torch.distributed.get_rank(), 2 * torch.distributed.get_rank() + 2)
    got = nxd_model.run_train(input_ids=ids[rows], labels=labels[rows])
    torch.testing.assert_close(got, want.detach(), **hf_parity.TOL)


def encoder_head_cases() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        for name, case in (("masked LM dp2 zero1 accumulate2", dict(batch=2, accumulate=2, zero_1=True)),
                           ("masked LM tp2", dict(batch=4, tensor_parallel_size=2)),
                           # 5 samples, global batch 4: the batch of 1 leaves a replica a stand-in row
                           ("masked LM dp2 short last batch", dict(batch=2, samples=5)),
                           ("token classification dp2 accumulate2", dict(batch=2, accumulate=2, tagging=True)),
                           ("token classification tp2", dict(batch=4, tensor_parallel_size=2, tagging=True)),
                           ("token classification LoRA dp2", dict(batch=2, tagging=True, lora=True)),
                           # the last stage applies HF's loss_function (ForMaskedLM, ForTokenClassification)
                           ("masked LM pp2", dict(batch=4, pipeline_parallel_size=2, num_microbatches=2)),
                           ("token classification pp2", dict(batch=4, pipeline_parallel_size=2, num_microbatches=2,
                                                             tagging=True)),
                           # no labels: start/end positions, a per-row mean weighted by the replica's rows
                           ("question answering tp2", dict(batch=4, tensor_parallel_size=2, spans=True)),
                           ("question answering dp2 accumulate2", dict(batch=2, accumulate=2, spans=True))):
            ref, ours = _run(out_dir, **case)
            _check_training(ref, ours, name)
            assert ours.nxd_model.own_mean_loss != ours.nxd_model.pipelined, name
    check_run_train_weights_the_replicas()


def test_masked_lm_and_token_classification_match_trainer(ranks2):
    ranks2.run(encoder_head_cases)


def test_which_forwards_compute_their_own_mean_loss():
    from nxd_hf.trainer.mean_loss import computes_own_mean_loss

    config = transformers.BertConfig(**hf_parity.ENCODER_TINY["bert"][2])
    assert computes_own_mean_loss(transformers.BertForMaskedLM(config))
    assert not computes_own_mean_loss(hf_parity.build_pair("llama")[1])  # through loss_function: num_items_in_batch
