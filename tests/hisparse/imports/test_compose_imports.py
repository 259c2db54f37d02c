# SPDX-License-Identifier: Apache-2.0
"""Composition of HiSparse with a P/D consumer's ExampleConnector (spec 6.2,
4.13; docs/pd-imports.md): the importer is installed for kv_consumer and
kv_both, every other P/D composition is refused with a one-line error that
names the setting."""

import pytest

from tests.hisparse.offloading.test_compose import (  # noqa: F401 (fixture)
    OFFLOAD_EXTRA,
    assert_hma_and_full_graphs_kept,
    child,
    children,
    config,
    ktc,
    multi,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.compose import (
    compose_kv_transfer_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.importing import (
    HiSparseImportingConnector,
    SparseMLAExampleConnector,
)

IMPORTING = "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.importing"
EXTRA = {"shared_storage_path": "/tmp/pd"}


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
@pytest.mark.parametrize(
    "name,module", [("ExampleConnector", None), ("SparseMLAExampleConnector", IMPORTING)]
)
def test_example_connector_gets_the_importer(config, role, name, module):
    c = config(ktc(name, role, kv_connector_extra_config=EXTRA,
                   kv_connector_module_path=module))
    assert c.kv_transfer_config.kv_connector == "MultiConnector"
    assert c.kv_transfer_config.kv_role == role
    hisparse, importer = children(c)
    assert hisparse == {"kv_connector": "HiSparseConnector", "kv_role": "kv_both"}
    assert importer == {
        "kv_connector": "HiSparseImportingConnector",
        "kv_connector_module_path": IMPORTING,
        "kv_role": role,
        "kv_connector_extra_config": EXTRA,
    }
    from vllm.config import KVTransferConfig

    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**importer))
    assert cls is HiSparseImportingConnector
    assert_hma_and_full_graphs_kept(c)


def test_an_example_child_of_a_multi_connector_is_swapped(config):
    c = config(multi(child("ExampleConnector", kv_role="kv_consumer",
                           kv_connector_extra_config=EXTRA), role="kv_consumer"))
    names = [ch["kv_connector"] for ch in children(c)]
    assert names == ["HiSparseConnector", "HiSparseImportingConnector"]


def test_composing_an_import_is_a_fixed_point(config):
    c = config(ktc("ExampleConnector", "kv_consumer", kv_connector_extra_config=EXTRA))
    before = c.kv_transfer_config
    compose_kv_transfer_config(c)
    assert c.kv_transfer_config == before


def test_hisparse_off_keeps_the_example_connector(config):
    c = config(ktc("ExampleConnector", "kv_producer"), hisparse=False)
    assert c.kv_transfer_config.kv_connector == "ExampleConnector"
    assert SparseMLAExampleConnector.__mro__[1].__name__ == "ExampleConnector"


def test_a_producer_role_is_refused(config):
    with pytest.raises(ValueError, match="kv_role='kv_producer'.*prefill instance"):
        config(ktc("ExampleConnector", "kv_producer", kv_connector_extra_config=EXTRA))


def test_a_consumer_role_needs_an_importer(config):
    with pytest.raises(ValueError, match="kv_role='kv_consumer'"):
        config(multi(child("OffloadingConnector",
                           kv_connector_extra_config=OFFLOAD_EXTRA), role="kv_consumer"))


def test_an_offloader_beside_an_importer_is_refused(config):
    with pytest.raises(ValueError, match="no OffloadingConnector beside it"):
        config(multi(child("OffloadingConnector", kv_connector_extra_config=OFFLOAD_EXTRA),
                     child("ExampleConnector", kv_connector_extra_config=EXTRA)))


def test_two_importers_are_refused(config):
    with pytest.raises(ValueError, match="through one ExampleConnector"):
        config(multi(child("ExampleConnector"), child("ExampleConnector")))
