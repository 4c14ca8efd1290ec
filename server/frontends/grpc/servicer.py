"""`inference.GRPCInferenceService`: each RPC translates protobuf to the core's call and the result back.

No inference, repository or statistics logic lives here; the HTTP frontend calls the same core methods.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from server.core.decoupled import GRPC_REFUSAL, HTTP_REFUSAL, StreamPart, stream_parts
from server.core.errors import ServerError
from server.core.grouping import Answer, outcome
from server.core.limits import check_load_request
from server.protos import grpc_service_pb2 as pb
from server.protos import grpc_service_pb2_grpc

from . import convert, wire
from .errors import status_of, translate_errors
from .options import GrpcOptions


class InferenceServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton's GRPCInferenceService over a `server.core` instance."""

    def __init__(self, core, options: GrpcOptions) -> None:
        self._core = core
        self._options = options

    # -- health ---------------------------------------------------------------------------------------------
    @translate_errors
    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=await self._core.live())

    @translate_errors
    async def ServerReady(self, request: pb.ServerReadyRequest, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._core.ready())

    @translate_errors
    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self._core.model_ready(request.name, request.version))

    # -- metadata -------------------------------------------------------------------------------------------
    @translate_errors
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context) -> pb.ServerMetadataResponse:
        return convert.from_dict(await self._core.server_metadata(), pb.ServerMetadataResponse)

    @translate_errors
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context) -> pb.ModelMetadataResponse:
        metadata = await self._core.model_metadata(request.name, request.version)
        return convert.from_dict(metadata, pb.ModelMetadataResponse)

    @translate_errors
    async def ModelConfig(self, request: pb.ModelConfigRequest, context) -> pb.ModelConfigResponse:
        config = await self._core.model_config(request.name, request.version)
        return pb.ModelConfigResponse(config=convert.model_config(config))

    @translate_errors
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context) -> pb.ModelStatisticsResponse:
        stats = await self._core.model_statistics(request.name, request.version)
        return convert.from_dict(stats, pb.ModelStatisticsResponse)

    # -- inference ------------------------------------------------------------------------------------------
    async def _infer(self, request: pb.ModelInferRequest, context: Any = None) -> pb.ModelInferResponse:
        try:
            converted = convert.infer_request(request)
            converted.traceparent = _traceparent(context)
        except ServerError:
            # Triton looks the model up before it reads the tensors: an unknown model is NOT_FOUND, whatever else
            # is wrong with the request (model_metadata raises exactly that; asked only on this error path)
            await self._core.model_metadata(request.model_name, request.model_version)
            raise
        try:
            response = await self._core.infer(converted)
        except ServerError as e:
            raise _grpc_wording(e) from None
        return convert.infer_response(response)

    @translate_errors
    async def ModelInfer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        return await self._infer(request, context)

    def submit_infer(self, request: pb.ModelInferRequest, reply: Answer, context: Any = None) -> asyncio.Future | None:
        """ModelInfer without a task: `reply(response, None)` or `reply(None, error)` comes from the job's
        completion (the core's `submit_infer`); returns what to cancel to withdraw the request. Requests that do
        not convert, and cores without `submit_infer` (a frontend process's RemoteCore), take the task road."""
        submit = getattr(self._core, "submit_infer", None)
        converted = None
        if submit is not None:
            try:
                converted = convert.infer_request(request)
                converted.traceparent = _traceparent(context)
            except ServerError:
                pass  # _infer raises it again, after the model lookup that decides between NOT_FOUND and it
        if converted is None:
            task = asyncio.ensure_future(self._infer(request, context))
            task.add_done_callback(lambda done: reply(*outcome(done)))
            return task

        def converted_reply(response: Any, error: BaseException | None) -> None:
            if isinstance(error, ServerError):
                error = _grpc_wording(error)
            if error is None:
                try:
                    response = convert.infer_response(response)
                except Exception as e:  # noqa: BLE001 - answered as the error it is
                    response, error = None, e
            reply(response, error)

        return submit(converted, converted_reply)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Many requests in flight per stream; responses in completion order, matched by `id`.

        A failed request yields a message with `error_message` set (and its id) while the stream goes on. A
        decoupled model's request yields one message per response it sends (zero or more); every response carries
        the parameter `triton_final_response` (true on a request's last), and a final flag sent without a response
        becomes an empty response only when the request asks with `triton_enable_empty_final_response`, as in
        Triton (grpc/stream_infer_handler.cc). At most `max_stream_inflight` requests per stream are running or
        waiting to be sent; beyond that the server stops reading the stream (backpressure on a client that sends
        faster than it reads).
        """
        responses: asyncio.Queue[Any] = asyncio.Queue()  # messages, _DONE after each request's last, None at the end
        slots = asyncio.Semaphore(self._options.max_stream_inflight)
        running: set[asyncio.Task] = set()

        async def answer(request: pb.ModelInferRequest) -> None:
            empty_final = _asks_empty_final(request)
            try:
                async for part in self._stream_parts(request):
                    message = _stream_message(request, part, empty_final)
                    if message is not None:
                        await responses.put(message)
            except Exception as error:  # noqa: BLE001 - reported in-band; bugs are logged by status_of
                await responses.put(_stream_message(request, StreamPart(error=error, final=True), empty_final))
            await responses.put(_DONE)

        async def read_requests() -> None:
            try:
                async for request in request_iterator:
                    await slots.acquire()
                    task = asyncio.create_task(answer(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.wait(set(running))
            finally:
                await responses.put(None)

        reader = asyncio.create_task(read_requests())
        try:
            while (message := await responses.get()) is not None:
                if message is _DONE:
                    slots.release()  # a slot covers a request from read until its last response is sent
                    continue
                yield message
            await reader  # surfaces a failure of the request stream itself
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def _stream_parts(self, request: pb.ModelInferRequest) -> AsyncIterator[StreamPart]:
        """One stream request's parts from the core (`submit_stream`); a request that does not convert fails as
        ModelInfer's does (NOT_FOUND first for an unknown model)."""
        try:
            converted = convert.infer_request(request)
        except ServerError:
            await self._core.model_metadata(request.model_name, request.model_version)
            raise
        async for part in stream_parts(self._core.submit_stream, converted):
            yield part

    # -- repository -----------------------------------------------------------------------------------------
    @translate_errors
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context) -> pb.RepositoryIndexResponse:
        index = await self._core.repository_index(ready=request.ready)
        return convert.from_dict({"models": index}, pb.RepositoryIndexResponse)

    @translate_errors
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context) -> pb.RepositoryModelLoadResponse:
        config, files = convert.load_parameters(request.parameters)
        check_load_request(request.model_name, config, files)
        await self._core.load_model(request.model_name, config, files)
        return pb.RepositoryModelLoadResponse()

    @translate_errors
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context) -> pb.RepositoryModelUnloadResponse:
        await self._core.unload_model(request.model_name, **convert.unload_parameters(request.parameters))
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory --------------------------------------------------------------------------------------
    @translate_errors
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context) -> pb.SystemSharedMemoryStatusResponse:
        regions = await self._core.system_shared_memory_status(request.name)
        return convert.from_dict({"regions": {r["name"]: r for r in regions}}, pb.SystemSharedMemoryStatusResponse)

    @translate_errors
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context) -> pb.SystemSharedMemoryRegisterResponse:
        await self._core.register_system_shared_memory(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @translate_errors
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context) -> pb.SystemSharedMemoryUnregisterResponse:
        await self._core.unregister_system_shared_memory(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @translate_errors
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest,
                                     context) -> pb.CudaSharedMemoryStatusResponse:
        regions = await self._core.cuda_shared_memory_status(request.name)
        return convert.from_dict({"regions": {r["name"]: r for r in regions}}, pb.CudaSharedMemoryStatusResponse)

    @translate_errors
    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest,
                                       context) -> pb.CudaSharedMemoryRegisterResponse:
        await self._core.register_cuda_shared_memory(
            request.name, request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @translate_errors
    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context) -> pb.CudaSharedMemoryUnregisterResponse:
        await self._core.unregister_cuda_shared_memory(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- settings -------------------------------------------------------------------------------------------
    @translate_errors
    async def TraceSetting(self, request: pb.TraceSettingRequest, context) -> pb.TraceSettingResponse:
        updates = convert.trace_settings_from_proto(request.settings)
        settings = await self._core.trace_settings(request.model_name, updates)
        return convert.trace_settings_to_proto(settings)

    @translate_errors
    async def LogSettings(self, request: pb.LogSettingsRequest, context) -> pb.LogSettingsResponse:
        updates = {key: convert.oneof_value(value) for key, value in request.settings.items()}
        settings = await self._core.log_settings(updates)
        return convert.log_settings_to_proto(settings)


def add_to_server(core, options: GrpcOptions, server) -> None:
    """Register the servicer with `server` (a `GrpcServer`: grpcio's registration methods, plus the callback
    road for ModelInfer)."""
    servicer = InferenceServicer(core, options)
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    server.add_submitter("/inference.GRPCInferenceService/ModelInfer", servicer.submit_infer, wire.read_infer_request)


_DONE = object()  # a stream request's last message was queued: its in-flight slot frees once that is sent
EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"
FINAL_PARAMETER = "triton_final_response"


def _grpc_wording(error: ServerError) -> ServerError:
    """The core refuses a decoupled model with HTTP's text; ModelInfer says Triton's gRPC one."""
    return ServerError(error.kind, GRPC_REFUSAL) if error.message == HTTP_REFUSAL else error


def _asks_empty_final(request: pb.ModelInferRequest) -> bool:
    parameter = request.parameters.get(EMPTY_FINAL_PARAMETER)
    return parameter is not None and parameter.bool_param


def _stream_message(request: pb.ModelInferRequest, part: StreamPart,
                    empty_final: bool) -> pb.ModelStreamInferResponse | None:
    """One part as Triton's stream message: the response, or its error (id, model and version kept), or the empty
    final response (only when asked for); every one says whether it is the request's last."""
    if part.response is not None:
        try:
            message = pb.ModelStreamInferResponse(infer_response=convert.infer_response(part.response))
        except Exception as error:  # noqa: BLE001 - this response fails in-band
            return _stream_message(request, StreamPart(error=error, final=part.final), empty_final)
    elif part.error is not None or empty_final:
        message = pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id))
        if part.error is not None:
            message.error_message = status_of(part.error)[1]
    else:
        return None
    message.infer_response.parameters[FINAL_PARAMETER].bool_param = part.final
    return message


def _traceparent(context: Any) -> str:
    """The call's W3C `traceparent` metadata ("" without one), which OpenTelemetry traces continue."""
    if context is None:
        return ""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode("latin-1")
    return ""
