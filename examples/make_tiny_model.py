"""Rebuild the tiny model bundled in examples/data/tiny-llama (the examples' default):
a byte-level BPE tokenizer trained on examples/data/tiny_corpus.txt and a randomly initialized
Llama whose shapes hit the hard cases (vocab 301: padded at any tp > 1; 4 query heads over 2
K/V heads: K/V replicated at tp=4). The tokenizer has a chat template (assistant turns marked
for TRL's ``assistant_only_loss``).

    python examples/make_tiny_model.py [--out DIR]
"""

import argparse
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<eos>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def build_tokenizer(text: str) -> transformers.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=301, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>",
                                                chat_template=CHAT_TEMPLATE)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(DATA, "tiny-llama"))
    args = parser.parse_args()
    tokenizer = build_tokenizer(open(os.path.join(DATA, "tiny_corpus.txt")).read())
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
