"""Job-level checks of the memory transforms, before any process group starts."""

from __future__ import annotations

from titan_upipe.config import ConfigError

TRANSFORM_NAMES = ("tiled_mlp", "tiled_rmsnorm", "fused_rope", "fused_ce")


def known_converters() -> list[str]:
    from torchtitan.protocols import model_converter

    import titan_upipe.registry

    titan_upipe.registry.register_all()
    return sorted(model_converter._registry_model_converter_cls)


def check_converter_names(converters: list[str]) -> None:
    known = known_converters()
    unknown = [name for name in converters if name not in known]
    if unknown:
        raise ConfigError(f"model.converters has unknown name(s) {unknown}: valid values are {', '.join(known)}")
    repeated = sorted({name for name in converters if converters.count(name) > 1})
    if repeated:
        raise ConfigError(f"model.converters names {repeated} more than once: list each converter once")


def check_offload(job_config) -> None:
    ac = job_config.activation_checkpoint
    if not getattr(ac, "cpu_offload", False):
        return
    if ac.mode != "full":
        raise ConfigError(
            f"activation_checkpoint.cpu_offload = true needs activation_checkpoint.mode = \"full\" "
            f"(got {ac.mode!r}): offloading keeps each block's checkpointed input on the host; "
            "valid values with offload: full"
        )
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError("activation_checkpoint.cpu_offload = true does not support compile.enable with the "
                          "'model' component: set compile.enable = false or cpu_offload = false")
    if not isinstance(getattr(ac, "pin_memory", True), bool):
        raise ConfigError(f"invalid activation_checkpoint.pin_memory = {ac.pin_memory!r}: valid values are true, false")


def check_transforms(job_config) -> None:
    """Converter names, tile sizes and backends, offload settings; raises ConfigError."""
    check_converter_names(list(job_config.model.converters))
    transforms = getattr(job_config, "transforms", None)
    if transforms is not None:
        type(transforms).__post_init__(transforms)  # CLI/TOML values, re-checked after overrides
        if "fused_ce" in job_config.model.converters:
            from titan_upipe.transforms.fused_ce import resolve_backend

            resolve_backend(transforms.ce_backend)
    check_offload(job_config)
