"""A model given to a TRL trainer by name or directory (``SFTTrainer(model="Qwen/Qwen2-0.5B")``,
as TRL's own scripts pass it), loaded as TRL loads it, for nxd_hf to parallelize."""


def load_named_model(model: str, args, trainer_kwargs: dict, *, trainer: str, quantization_config=None,
                     architecture=None, **forced):
    """``model`` loaded with TRL's ``create_model_from_path`` (``architecture``: an auto class, else
    the one the config names) and ``args.model_init_kwargs`` (dtype float32 unless they say
    otherwise, ``args.trust_remote_code``), then ``forced`` (RewardTrainer's ``num_labels=1``).
    Unlike TRL's it stays on the CPU (``device_map`` None unless given): nxd_hf shards it and
    places each rank's part, where ``device_map="auto"`` would spread every rank's whole copy over
    all its GPUs. Sets
    ``trainer_kwargs["processing_class"]`` at the model's revision when one is given and none is."""
    from trl.trainer.utils import create_model_from_path

    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None or "quantization_config" in kwargs:
        raise ValueError(f"quantization_config is not supported by nxd_hf's {trainer}: nxd_hf shards full-precision "
                         "weights; train the model in fp32 or bf16 (bf16=True)")
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("device_map", None)
    kwargs.update(forced)
    loaded = create_model_from_path(model, architecture, **kwargs)
    args.model_init_kwargs = None  # used: the trainer would warn that they are ignored for a model object
    revision = kwargs.get("revision")
    if revision is not None and trainer_kwargs.get("processing_class") is None:
        from transformers import AutoProcessor

        trainer_kwargs["processing_class"] = AutoProcessor.from_pretrained(
            model, revision=revision, trust_remote_code=args.trust_remote_code)
    return loaded
