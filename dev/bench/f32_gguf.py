"""Write an F32 GGUF of a quantized one: the same metadata, every tensor dequantized.

The F32 file holds exactly the fp32 weights rung's dequantizing loader reads from the
quantized file, so rung (fp32), HF transformers and llama.cpp can be compared on one
set of weights at the memory limit of fp32 GEMV:

    python dev/bench/f32_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-f32.gguf
"""

from __future__ import annotations

import argparse

import numpy as np

from rung.models.gguf import _numpy_shape, dequantize, open_reader
from rung.models.loader import resolve_model_path

_FILE_TYPE_ALL_F32 = 0        # llama.cpp's LLAMA_FTYPE_ALL_F32


def write_f32_gguf(src: str, dst: str) -> int:
    """Copy ``src`` to ``dst`` with F32 tensors (llama.cpp's own names and row order);
    returns how many tensors were written."""
    import gguf

    reader = open_reader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue              # the writer writes the header and architecture itself
        value = _FILE_TYPE_ALL_F32 if key == "general.file_type" else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        array = dequantize(t.data, t.tensor_type.name, _numpy_shape(t))
        writer.add_tensor(t.name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(reader.tensors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src", help="a GGUF file or a named model (smollm2-135m)")
    p.add_argument("dst", help="the F32 GGUF file to write")
    args = p.parse_args()
    count = write_f32_gguf(resolve_model_path(args.src), args.dst)
    print(f"wrote {count} F32 tensors to {args.dst}")


if __name__ == "__main__":
    main()
