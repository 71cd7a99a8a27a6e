"""BERT (encoder): BertModel and its task models (sequence classification, masked LM, ...).

No sequence parallelism. The masked-LM decoder ``cls.predictions.decoder`` is tied to the
vocab-sharded word embeddings, so it is sharded the same way and gathers its logits
(``Column(gather_output=True)``): BERT computes its MLM loss inline with ``CrossEntropyLoss``
over full logits, hence ``lm_head=None`` (no vocab-parallel loss contract is installed).
Pooler and classifiers stay replicated.
"""

from nxd_hf.tp.plan import Attention, Column, Embedding, ModelPatch, Row
from nxd_hf.tp.registry import register_patch

PLAN = {
    "embeddings.word_embeddings": Embedding(),
    # BertSelfAttention views with attention_head_size and -1; the head counts are set for
    # consistency (HF code outside forward reads them).
    "encoder.layer.*.attention.self": Attention(attrs=(("num_attention_heads", "num_heads"),
                                                       ("all_head_size", "q_size"))),
    "encoder.layer.*.attention.self.query": Column(heads="q"),
    "encoder.layer.*.attention.self.key": Column(heads="kv"),  # MHA: same rows as the queries
    "encoder.layer.*.attention.self.value": Column(heads="kv"),
    "encoder.layer.*.attention.output.dense": Row(heads="q"),
    "encoder.layer.*.intermediate.dense": Column(),
    "encoder.layer.*.output.dense": Row(),
    # Outside the base model (matched by its full name): tied to word_embeddings.
    "cls.predictions.decoder": Column(gather_output=True),
}

PATCH = register_patch(ModelPatch(
    model_type="bert", plan=PLAN, lm_head=None, sequence_parallel=False, num_kv_heads_attr=None,
))
