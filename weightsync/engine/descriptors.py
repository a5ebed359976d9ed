"""What travels between engines, serialized in one place: an engine's *address* (what a peer needs to
connect) and a region's *descriptor* (what a peer needs to write into it). Both are msgpack lists that
start with a version number and end with a CRC-32 of the rest, so a stale or corrupted blob is reported,
never written through. Opaque bytes to everybody else (safe to send through Ray)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

from weightsync.errors import TransportError

DESCRIPTOR_VERSION = 2  # 2: landing index and slot size
ADDRESS_VERSION = 1


@dataclass(frozen=True)
class Address:
    """An engine's address: its identity, provider, one address per NIC lane, its cuda lane (empty
    bytes: none offered) and per NIC the doorbell a copy's completion may be signalled into."""

    uid: str
    provider: str
    nic_addresses: list[bytes]
    cuda_address: bytes
    doorbell_bases: list[int]
    doorbell_keys: list[int]

    def pack(self) -> bytes:
        """The address as opaque bytes."""
        return _pack([ADDRESS_VERSION, self.uid, self.provider, list(self.nic_addresses), self.cuda_address,
                      list(self.doorbell_bases), list(self.doorbell_keys)])

    @classmethod
    def unpack(cls, blob: bytes) -> Address:
        """Decodes and checks an address (TransportError if corrupted or of another version)."""
        version, *rest = _unpack_checked(blob, "engine address", 7)
        if version != ADDRESS_VERSION:
            raise TransportError(f"engine address of version {version}, expected {ADDRESS_VERSION}")
        return cls(*rest)


@dataclass(frozen=True)
class Descriptor:
    """A registered region as a peer sees it: per NIC (base, key), whether the NICs registered it, the
    cuda lane's export (empty: none) and, for a landing region, its index and slot size (else -1, 0)."""

    engine_uid: str
    region_id: int
    nbytes: int
    kind: int
    nics: list[tuple[int, int]]
    on_fabric: bool
    cuda_blob: bytes
    landing: int
    slot_bytes: int

    def pack(self) -> bytes:
        """The descriptor as opaque bytes."""
        return _pack([DESCRIPTOR_VERSION, self.engine_uid, self.region_id, self.nbytes, self.kind,
                      [[int(b), int(k)] for b, k in self.nics], self.on_fabric, self.cuda_blob, self.landing,
                      self.slot_bytes])

    @classmethod
    def unpack(cls, blob: bytes) -> Descriptor:
        """Decodes and checks a descriptor (TransportError if corrupted or of another version)."""
        version, uid, region_id, nbytes, kind, nics, on_fabric, cuda_blob, landing, slot_bytes = (
            _unpack_checked(blob, "region descriptor", 10)
        )
        if version != DESCRIPTOR_VERSION:
            raise TransportError(f"region descriptor of version {version}, expected {DESCRIPTOR_VERSION}")
        return cls(uid, region_id, nbytes, kind, [(int(b), int(k)) for b, k in nics], on_fabric, cuda_blob,
                   int(landing), int(slot_bytes))


def crc(fields: list[Any]) -> int:
    """The checksum the last field of an address or descriptor holds."""
    return zlib.crc32(msgpack.packb(fields, use_bin_type=True))


def _pack(fields: list[Any]) -> bytes:
    return msgpack.packb([*fields, crc(fields)], use_bin_type=True)


def _unpack_checked(blob: bytes, what: str, nfields: int) -> list[Any]:
    """Decodes an address or descriptor and checks its CRC, so corruption is reported, not written."""
    try:
        fields = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise TransportError(f"corrupted {what}: {exc}") from None
    if not isinstance(fields, list) or len(fields) != nfields + 1:
        raise TransportError(f"corrupted {what}: unexpected structure")
    *body, checksum = fields
    if crc(body) != checksum:
        raise TransportError(f"corrupted {what}: checksum mismatch")
    return body


__all__ = ["ADDRESS_VERSION", "DESCRIPTOR_VERSION", "Address", "Descriptor", "crc"]
