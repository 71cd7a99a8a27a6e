"""NxD's ``LoRAModel(module, lora_config)``: a model with LoRA adapters, over nxd_hf's LoRA
bridge (``inject_lora``: peft's adapters on nxd_hf's parallel layers)."""

from torch import nn

from nxd_hf.lora.inject import inject_lora


class LoRAModel(nn.Module):
    """``module`` (a model parallelized by ``nxd_hf.parallelize``, an ``NxDPPModel``, or any
    module of nxd_hf/torch layers) with LoRA adapters added in place as ``lora_config`` says
    (NxD's ``nxd_hf.modules.lora.LoraConfig`` or a ``peft.LoraConfig``); only the adapters
    (and the biases ``bias`` names) stay trainable. Calls and ``run_train``/``run_eval`` go to
    ``module``. With the config API, pass ``lora_config`` to ``neuronx_distributed_config``
    instead: it also saves and loads the adapters through ``save_checkpoint``."""

    def __init__(self, module: nn.Module, lora_config):
        super().__init__()
        stages = getattr(module, "stages", None)  # an NxDPPModel: adapters on this rank's stages
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        inject_lora(list(stages.values()) if stages is not None else module, lora_config, model_type=model_type)
        self.module, self.lora_config = module, lora_config

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def run_train(self, *args, **kwargs):
        return self.module.run_train(*args, **kwargs)

    def run_eval(self, *args, **kwargs):
        return self.module.run_eval(*args, **kwargs)

    def get_base_model(self) -> nn.Module:
        return self.module

    @property
    def config(self):
        return self.module.config
