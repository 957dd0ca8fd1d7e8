"""DeepSeek-V4 for amct_ext: config, float reference, checkpoint loading, quant wrappers, adapter.

Nothing here registers with transformers' Auto classes: transformers >= 5.10 owns the model_type
``deepseek_v4`` (see casebook/deepseek-v4.md, "two DeepseekV4 classes").

Every name is imported on first use: importing a light submodule (``models.deepseek_v4.cli``,
which a CLI imports to print an error) must not pay for transformers (~3 s)."""
from .binding import V4_BINDING  # noqa: E402,F401  (registers V4 with amct_ext.base.model_binding; no transformers import)

__all__ = ["DeepseekV4Config", "DeepseekV4ForCausalLM", "load_checkpoint_model", "quantize"]


def __getattr__(name):
    if name == "DeepseekV4Config":
        from .configuration import DeepseekV4Config

        return DeepseekV4Config
    if name == "DeepseekV4ForCausalLM":
        from .modeling import DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM
    # loading pulls in the checkpoint reader; import it on first use
    if name == "load_checkpoint_model":
        from .loading import load_checkpoint_model

        return load_checkpoint_model
    # the whole PTQ job as a library call (amct_ext.pipeline.options.quantize), V4 registered:
    # quantize("runs/w4", model="tiny-trained", scheme="w4a16-g128") -> its report
    if name == "quantize":
        from amct_ext.pipeline.options import quantize

        return quantize
    raise AttributeError(name)
