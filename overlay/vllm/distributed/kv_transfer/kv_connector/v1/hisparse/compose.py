# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compose HiSparse's connector with ``--kv-transfer-config`` (spec 6.2).

``hisparse_config`` alone enables HiSparse; the connector it needs is
installed here, from ``VllmConfig.__post_init__`` (after vLLM resolves
``--kv-offloading-size`` into a connector, before its HMA decision):

====================================  ======================================
user's kv_transfer_config             composed
====================================  ======================================
none                                  HiSparseConnector (kv_both)
OffloadingConnector (any spec)        MultiConnector[HiSparseConnector,
                                      HiSparseOffloadingConnector (same
                                      extra config)]
ExampleConnector or                   MultiConnector[HiSparseConnector,
SparseMLAExampleConnector,            HiSparseImportingConnector (same role
kv_consumer or kv_both (P/D decode)   and extra config)], the user's role
MultiConnector[...]                   HiSparseConnector first (inserted if
                                      absent), every OffloadingConnector
                                      child -> HiSparseOffloadingConnector,
                                      an ExampleConnector child ->
                                      HiSparseImportingConnector
HiSparseConnector                     accepted as is
kv_producer, an offloader beside an   HiSparseConfigError naming the setting
importer, any other connector
====================================  ======================================

P/D (spec 4.13, docs/pd-imports.md): HiSparse runs on the decode instance
and imports what a HiSparse-off prefill instance saved; the composed
importer only imports (under kv_both too). An offloader beside it is refused:
both would claim a request's external tokens.

``host_pool_gib`` may be given in an explicit HiSparseConnector's
``kv_connector_extra_config``; it is moved into ``hisparse_config`` (the one
place every later reader looks), and two different values are an error.

The result is a fixed point: composing a composed config changes nothing,
so the hook is safe wherever ``VllmConfig.__post_init__`` runs again. Every
connector it installs supports HMA and none requires PIECEWISE graphs, so
vLLM's HMA auto-disable and PIECEWISE downgrade never trigger because of it.
"""

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.hisparse.config_checks import HiSparseConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.hisparse import HiSparseConfig

HISPARSE = "HiSparseConnector"
HISPARSE_OFFLOADING = "HiSparseOffloadingConnector"
HISPARSE_IMPORTING = "HiSparseImportingConnector"
OFFLOADING = "OffloadingConnector"
EXAMPLE = "ExampleConnector"
SPARSE_EXAMPLE = "SparseMLAExampleConnector"
MULTI = "MultiConnector"

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
# The connectors HiSparse composes with, by registered name, with the module
# that defines each (an explicit kv_connector_module_path must name it).
_MODULES = {
    HISPARSE: f"{_V1}.hisparse.connector",
    HISPARSE_OFFLOADING: f"{_V1}.hisparse.offloading",
    HISPARSE_IMPORTING: f"{_V1}.hisparse.importing",
    OFFLOADING: f"{_V1}.offloading_connector",
    EXAMPLE: f"{_V1}.example_connector",
    SPARSE_EXAMPLE: f"{_V1}.hisparse.importing",
    MULTI: f"{_V1}.multi_connector",
}
_ROLE = "kv_both"
_CONSUMER = "kv_consumer"
# Connectors whose P/D files HiSparse imports; the composed child is always
# the importer, named with its module (it is not in vLLM's registry).
_IMPORTERS = (EXAMPLE, SPARSE_EXAMPLE, HISPARSE_IMPORTING)


def compose_kv_transfer_config(vllm_config: "VllmConfig") -> None:
    """Install or validate HiSparse's connector; a no-op when HiSparse is off.

    Raises:
        HiSparseConfigError: a P/D role, a connector HiSparse cannot compose
            with, or two different ``host_pool_gib`` values.
    """
    attention_config = vllm_config.attention_config
    if attention_config.hisparse_config is None:
        return
    vllm_config.kv_transfer_config, attention_config.hisparse_config = _compose(
        vllm_config.kv_transfer_config, attention_config.hisparse_config
    )


def _compose(
    ktc: KVTransferConfig | None, hisparse_config: "HiSparseConfig"
) -> tuple[KVTransferConfig, "HiSparseConfig"]:
    if ktc is None or ktc.kv_connector is None:
        return _hisparse_alone(ktc), hisparse_config
    where = "kv_transfer_config"
    _check_connector(ktc.kv_connector, ktc.kv_role, ktc.kv_connector_module_path, where)
    extra = ktc.kv_connector_extra_config
    if ktc.kv_connector == HISPARSE:
        return ktc, _adopt_host_pool_gib(hisparse_config, extra, where)
    if ktc.kv_connector == MULTI:
        connectors, hisparse_config = _compose_children(
            extra.get("connectors"), hisparse_config
        )
        if ktc.kv_role == _CONSUMER and not _imports(connectors):
            _check_role(ktc.kv_role, f"{where} (no ExampleConnector child)")
        composed = {**extra, "connectors": connectors}
        ktc = dataclasses.replace(ktc, kv_connector_extra_config=composed)
        return ktc, hisparse_config
    if ktc.kv_connector in _IMPORTERS:
        wrapped = dataclasses.replace(
            ktc,
            kv_connector=MULTI,
            kv_connector_module_path=None,
            kv_connector_extra_config={
                "connectors": [_hisparse_child(), _importer_child(ktc.kv_role, extra)]
            },
        )
        return wrapped, hisparse_config
    # An offloader: it keeps the indexer KV, HiSparse the sparse-MLA KV.
    offloader = {
        "kv_connector": HISPARSE_OFFLOADING,
        "kv_role": _ROLE,
        "kv_connector_extra_config": dict(extra),
    }
    wrapped = dataclasses.replace(
        ktc,
        kv_connector=MULTI,
        kv_connector_module_path=None,
        kv_connector_extra_config={"connectors": [_hisparse_child(), offloader]},
    )
    return wrapped, hisparse_config


def _hisparse_child() -> dict[str, Any]:
    return {"kv_connector": HISPARSE, "kv_role": _ROLE}


def _importer_child(role: str | None, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The P/D consumer side under HiSparse, with the user's role and extra
    config (``shared_storage_path``)."""
    return {
        "kv_connector": HISPARSE_IMPORTING,
        "kv_connector_module_path": _MODULES[HISPARSE_IMPORTING],
        "kv_role": role or _ROLE,
        "kv_connector_extra_config": dict(extra),
    }


def _imports(children: list[dict[str, Any]]) -> bool:
    return any(c.get("kv_connector") == HISPARSE_IMPORTING for c in children)


def _hisparse_alone(ktc: KVTransferConfig | None) -> KVTransferConfig:
    """HiSparseConnector in a config that names no connector (keeping, e.g.,
    its engine_id)."""
    if ktc is None:
        return KVTransferConfig(kv_connector=HISPARSE, kv_role=_ROLE)
    _check_role(ktc.kv_role, "kv_transfer_config")
    return dataclasses.replace(ktc, kv_connector=HISPARSE, kv_role=_ROLE)


def _compose_children(
    children: Any, hisparse_config: "HiSparseConfig"
) -> tuple[list[dict[str, Any]], "HiSparseConfig"]:
    """A MultiConnector's children: HiSparseConnector first, offloaders
    swapped for the HiSparse-aware one, anything else refused."""
    where = "kv_transfer_config.kv_connector_extra_config.connectors"
    if not children:
        raise HiSparseConfigError(
            f"{where} is empty; a MultiConnector needs its child connectors "
            f"(HiSparse composes with {OFFLOADING})."
        )
    hisparse: dict[str, Any] | None = None
    others: list[dict[str, Any]] = []
    for i, child in enumerate(children):
        child_where = f"{where}[{i}]"
        name = child.get("kv_connector")
        _check_connector(
            name,
            child.get("kv_role"),
            child.get("kv_connector_module_path"),
            child_where,
            allow_multi=False,
        )
        if name == HISPARSE:
            if hisparse is not None:
                raise HiSparseConfigError(
                    f"{child_where}.kv_connector={HISPARSE!r} appears twice; "
                    "list HiSparseConnector once."
                )
            hisparse = dict(child)
            hisparse_config = _adopt_host_pool_gib(
                hisparse_config,
                child.get("kv_connector_extra_config") or {},
                child_where,
            )
        elif name == OFFLOADING:
            swapped = {
                k: v for k, v in child.items() if k != "kv_connector_module_path"
            }
            others.append({**swapped, "kv_connector": HISPARSE_OFFLOADING})
        elif name in _IMPORTERS:
            others.append(_importer_child(
                child.get("kv_role"), child.get("kv_connector_extra_config") or {}
            ))
        else:
            others.append(dict(child))
    names = [c["kv_connector"] for c in others]
    if names.count(HISPARSE_IMPORTING) > 1 or (
        HISPARSE_IMPORTING in names and HISPARSE_OFFLOADING in names
    ):
        raise HiSparseConfigError(
            f"{where}: HiSparse imports P/D KV through one ExampleConnector and "
            f"no {OFFLOADING} beside it (both would claim a request's external "
            "tokens); list one of them."
        )
    # First, so that its worker hooks run before the offloader's and the
    # composed config is canonical (it never claims external tokens, so the
    # MultiConnector's "first child with a hit loads" policy is unaffected).
    return [hisparse or _hisparse_child(), *others], hisparse_config


def _check_connector(
    name: str | None,
    role: str | None,
    module_path: str | None,
    where: str,
    allow_multi: bool = True,
) -> None:
    _check_role(role, where, consumer=name in _IMPORTERS or name == MULTI)
    known = name in _MODULES and (allow_multi or name != MULTI)
    if not known or module_path not in (None, _MODULES[name]):
        shown = name if module_path is None else f"{name} from {module_path}"
        raise HiSparseConfigError(
            f"HiSparse composes only with {OFFLOADING} (any offloading spec; "
            f"it keeps the indexer KV while HiSparse keeps the sparse-MLA KV) "
            f"or, on a P/D decode instance, {EXAMPLE}, optionally inside a "
            f"{MULTI}; {where}.kv_connector={shown!r} is not supported. Remove "
            "it, or remove attention_config.hisparse_config."
        )


def _check_role(role: str | None, where: str, consumer: bool = False) -> None:
    allowed = (None, _ROLE, _CONSUMER) if consumer else (None, _ROLE)
    if role in allowed:
        return
    if consumer:
        raise HiSparseConfigError(
            f"HiSparse does not support {where}.kv_role={role!r}: it runs on the "
            f"P/D decode instance ({_CONSUMER!r} or {_ROLE!r}); run the prefill "
            "instance with HiSparse off."
        )
    raise HiSparseConfigError(
        f"HiSparse does not support {where}.kv_role={role!r} (only {_ROLE!r}) "
        f"with this connector; disaggregated prefill/decode needs {EXAMPLE} "
        f"({_CONSUMER!r}) on the decode instance."
    )


def _adopt_host_pool_gib(
    hisparse_config: "HiSparseConfig", extra: Mapping[str, Any], where: str
) -> "HiSparseConfig":
    """``host_pool_gib`` of an explicit HiSparseConnector, moved into
    ``hisparse_config`` (spec 6.1/6.2)."""
    value = extra.get("host_pool_gib")
    if value is None:
        return hisparse_config
    setting = f"{where}.kv_connector_extra_config.host_pool_gib"
    value = float(value)
    if not value > 0:
        raise HiSparseConfigError(
            f"{setting}={value} must be > 0 (GiB of pinned host memory per DP replica)."
        )
    configured = hisparse_config.host_pool_gib
    if configured is None:
        return dataclasses.replace(hisparse_config, host_pool_gib=value)
    if configured != value:
        raise HiSparseConfigError(
            f"hisparse_config.host_pool_gib={configured} and {setting}={value} "
            "differ; set host_pool_gib in one place (or the same value in both)."
        )
    return hisparse_config


__all__ = [
    "HISPARSE",
    "HISPARSE_IMPORTING",
    "HISPARSE_OFFLOADING",
    "compose_kv_transfer_config",
]
