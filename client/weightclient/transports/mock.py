"""An in-memory server for unit tests: `WeightServiceClient("mock", connect=MockServer().connect)`.
`fail[method]`: errors its next calls raise; `corrupt`: transports that flip a byte; `calls`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import xxhash

from weightclient.core.failover import ServerLink
from weightclient.core.retry import Deadline
from weightclient.transports import Offer, OutgoingFile, Transport, TransportChain
from weightclient.transports.base import Answer, Into, Parts, Progress, Uploaded, into_sink
from weightserver.protocol.errors import InvalidRequest, ModelNotFound, VersionNotFound
from weightserver.protocol.version_info import VersionInfo
from weightserver.v1 import weights_pb2 as pb

KINDS = {"stream": pb.TRANSPORT_STREAM, "bulk": pb.TRANSPORT_BULK, "shm": pb.TRANSPORT_SHARED_MEMORY}


class MockServer:
    def __init__(self) -> None:
        self.versions: dict[str, list[tuple[pb.VersionInfo, bytes]]] = {}
        self.uploads: dict[str, bytes] = {}
        self.fail: dict[str, list[BaseException]] = {}
        self.corrupt: set[str] = set()
        self.calls: list[str] = []
        self._ids = itertools.count(1)

    def connect(self, address: str) -> ServerLink:
        chain = TransportChain([MockTransport(self, "bulk")], MockTransport(self, "stream"))
        return ServerLink(address, self, chain, MockTransport(self, "bulk"))

    def commit(self, model: str, data: bytes, version: int = 0) -> pb.VersionInfo:
        held = self.versions.setdefault(model, [])
        number = version or (held[-1][0].version + 1 if held else 1)
        info = pb.VersionInfo(model=model, version=number, byte_size=len(data), xxh3=xxhash.xxh3_128_hexdigest(data))
        held.append((info, bytes(data)))
        return info

    def called(self, method: str) -> None:
        self.calls.append(method)
        if self.fail.get(method):
            raise self.fail[method].pop(0)

    def find(self, request: pb.FetchRequest) -> tuple[pb.VersionInfo, bytes] | None:
        held = self.versions.get(request.model)
        if not held:
            raise ModelNotFound(f"no model {request.model!r}")
        if request.WhichOneof("selector") == "version":
            for info, data in held:
                if info.version == request.version:
                    return info, data
            raise VersionNotFound(f"{request.model!r} has no v{request.version}")
        newest = held[-1]
        return None if newest[0].version <= request.newer_than else newest

    def GetLatest(self, request: pb.GetLatestRequest, **_: object) -> pb.VersionInfo:
        self.called("GetLatest")
        return self.find(pb.FetchRequest(model=request.model))[0]  # type: ignore[index]

    def Negotiate(self, request: pb.NegotiateRequest, **_: object) -> pb.NegotiateResponse:
        self.called("Negotiate")
        bulk = pb.TRANSPORT_BULK in request.accept
        answer = pb.NegotiateResponse(transport=pb.TRANSPORT_BULK if bulk else pb.TRANSPORT_STREAM)
        if request.direction == pb.DIRECTION_PUBLISH:
            if bulk:
                answer.upload = f"upload-{next(self._ids)}"
                answer.payload.byte_size = request.publish.total_bytes
                answer.payload.bulk.ticket = answer.upload.encode()
            return answer
        found = self.find(request.fetch)
        if found is None:
            answer.up_to_date.latest_version = request.fetch.newer_than
            return answer
        answer.header.CopyFrom(found[0])
        if bulk:
            answer.payload.byte_size, answer.payload.xxh3 = found[0].byte_size, found[0].xxh3
        return answer


class MockTransport(Transport):
    def __init__(self, server: MockServer, name: str) -> None:
        self.server, self.name, self.kind = server, name, KINDS[name]

    def offer(
        self, request: pb.FetchRequest, answer: Answer, deadline: Deadline, info: VersionInfo, stall: float = 0.0
    ) -> Offer | None:
        if self.name != "stream":
            return super().offer(request, answer, deadline, info, stall)
        self.server.called("Fetch")
        found = self.server.find(request)
        if found is None:
            return None
        payload = pb.Payload(byte_size=found[0].byte_size, xxh3=found[0].xxh3)
        return Offer(VersionInfo.from_proto(found[0]), payload, chunks=iter([memoryview(found[1])]), deadline=deadline)

    def receive(self, offer: Offer, *, into: Into, progress: Progress | None) -> memoryview:
        self.server.called(f"{self.name}.receive")
        found = self.server.find(pb.FetchRequest(model=offer.info.model, version=offer.info.version))
        data = bytearray(found[1])  # type: ignore[index]
        if self.name in self.server.corrupt and data:
            data[0] ^= 0xFF
        if progress is not None:
            progress(len(data), len(data))
        return into_sink(memoryview(data), into)

    def upload(self, payload: pb.Payload, parts: Parts, *, deadline: Deadline, progress: Progress | None) -> Uploaded:
        self.server.called(f"{self.name}.upload")
        data = b"".join(parts)
        self.server.uploads[payload.bulk.ticket.decode()] = data
        return Uploaded(xxhash.xxh3_128_hexdigest(data))

    def send(
        self, files: Sequence[OutgoingFile], *, deadline: Deadline, progress: Progress | None
    ) -> pb.PublishResponse:
        self.server.called("Publish")
        version = files[0].header.version
        reply = pb.PublishResponse()
        for file in files:
            data = self.server.uploads.pop(file.uploaded) if file.uploaded else b"".join(file.parts)
            if xxhash.xxh3_128_hexdigest(data) != file.header.xxh3:
                raise InvalidRequest(f"{file.header.model!r}: the bytes do not match the declared xxh3")
            info = self.server.commit(file.header.model, data, version)
            version = info.version
            reply.versions.append(info)
        reply.version.CopyFrom(reply.versions[0])
        return reply
