"""Compile serve_clef's Hopper (Gluon) expert kernels for sm_90a on any machine, GPU or not, and report what the
assembler made of them: registers and spills per thread (which decide how many programs share an SM), shared
memory, the instructions a warp issues per step of the main loop, the writes into registers that tensor-core products
still in flight read (must be none), and optionally the SASS of one kernel, to read where ptxas put the waits
(docs/expert-kernels.md, "Pipeline").

Needs the triton whose Gluon dialect serve_clef is written against (3.6, the GPU image's; on a CPU machine:
`pip install --target DIR triton==3.6.0` and DIR first on PYTHONPATH). Uses the ptxas and nvdisasm that triton ships.
Compiles as the launcher does: pointers 16-byte aligned, hidden size and width multiples of 16.

Usage: python3 bench/inspect_gluon_kernels.py [--sass gate_up|down --rows R] (SASS to stdout)
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

import serve_clef  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTER_TYPES = {
    "hidden_states_ptr": "*bf16", "intermediate_ptr": "*bf16", "routing_weights_ptr": "*bf16",
    "pair_outputs_ptr": "*bf16", "slot_pairs_ptr": "*i32", "tile_experts_ptr": "*i32", "fragment_words_ptr": "*i32",
    "block_scales_ptr": "*i32", "global_scale_ptr": "*fp32", "tile_columns_done_ptr": "*i32",
    "down_input_scale_ptr": "*fp32",
}
MULTIPLES_OF_16 = ("hidden", "width")


def compile_for_hopper(kernel, constexprs: dict):
    names = list(kernel.arg_names)
    signature = {name: "constexpr" if name in constexprs else POINTER_TYPES.get(name, "i32") for name in names}
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in names
               if name not in constexprs and (name in POINTER_TYPES or name in MULTIPLES_OF_16)}
    source = GluonASTSource(fn=kernel, signature=signature, attrs=aligned,
                            constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})  # one warp group, as served


def assembler_report(compiled) -> dict:
    """ptxas -v on the kernel's PTX: registers and spill bytes a thread; shared memory from triton's metadata."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as ptx:
        ptx.write(compiled.asm["ptx"])
    log = subprocess.run([TOOLS / "ptxas", "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True)
    os.unlink(ptx.name)
    text = log.stdout + log.stderr
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", text).group(1))
    threads = 32 * compiled.metadata.num_warps
    # by registers (allocated 8 a thread at a time), shared memory (1 KiB a program for the driver) and 64 warps
    programs_per_sm = min(65536 // (-(-registers // 8) * 8 * threads), 228 * 1024 // (compiled.metadata.shared + 1024),
                          64 * 32 // threads)
    sass_text = sass(compiled)
    return {"registers": registers, "spill_stores_bytes": spilled, "shared_bytes": compiled.metadata.shared,
            "programs_per_sm": programs_per_sm, "loop_instructions": loop_instructions(sass_text),
            "in_flight_operand_writes": len(in_flight_operand_writes(sass_text))}


def sass(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as cubin:
        cubin.write(compiled.asm["cubin"])
    text = subprocess.run([TOOLS / "nvdisasm", "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    os.unlink(cubin.name)
    return text


def instructions(lines: list[str]) -> list[str]:
    """The instructions among nvdisasm's lines (those with an address comment), comments and `;` dropped."""
    return [re.sub(r"/\*.*?\*/", "", line).strip().rstrip(" ;") for line in lines
            if re.search(r"/\*[0-9a-f]{4,}\*/", line)]


def loops(sass_text: str) -> list[list[str]]:
    """Each loop of the kernel in code order: the instructions from the label that a conditional backward branch
    jumps to, through that branch."""
    lines = sass_text.splitlines()
    found = []
    for end, line in enumerate(lines):
        branch = re.search(r"@!?P\d+\s+BRA\s+`\((\.L_x_\d+)\)", line)
        starts = [i for i, label in enumerate(lines[:end]) if branch and label.strip() == f"{branch.group(1)}:"]
        if starts:
            found.append(instructions(lines[starts[0]:end + 1]))
    return found


def written_registers(instruction: str) -> set[int]:
    """The general registers an ALU or load instruction writes: its first operand, 1, 2 (.64) or 4 (.128) of them.
    Stores, branches, barriers and the tensor-core instructions themselves write none that matter here."""
    opcode, _, operands = re.sub(r"^@!?U?P\w+\s+", "", instruction).partition(" ")
    if opcode.startswith(("ST", "BRA", "BAR", "WARPGROUP", "HGMMA", "LDGSTS", "LDGDEPBAR", "DEPBAR", "RED", "ATOM",
                          "EXIT", "RET", "CALL", "NOP")):
        return set()
    first = re.fullmatch(r"R(\d+)", operands.split(",")[0].strip())
    if not first:
        return set()
    width = 4 if ".128" in opcode else 2 if ".64" in opcode or ".WIDE" in opcode else 1
    return set(range(int(first.group(1)), int(first.group(1)) + width))


def in_flight_operand_writes(sass_text: str, rounds: int = 3) -> list[str]:
    """Writes, inside a loop, into the registers that an asynchronous tensor-core product (HGMMA) still reads: its A
    operand (four registers from the one named) until a `WARPGROUP.DEPBAR.LE gsb0, N` has left at most N groups in
    flight. Each loop (label to conditional backward branch) is walked `rounds` times from nothing in flight, so a
    write in one iteration into what the previous iteration's products read is found in the second. Such a write makes
    the outputs change from run to run (docs/expert-kernels.md, "Pipeline"); ptxas does not prevent it."""
    found = []
    for body in loops(sass_text):
        in_flight, group = [], set()  # the A registers of each committed group, oldest first; of the one being built
        for walk in range(rounds):
            for instruction in body:
                if instruction.startswith("HGMMA"):
                    operand = re.search(r"HGMMA\S*\s+R\d+,\s+R(\d+)", instruction)
                    if operand:  # A from registers (from shared memory it names a descriptor)
                        group |= set(range(int(operand.group(1)), int(operand.group(1)) + 4))
                    if "gsb0" in instruction:  # the group's last product: committed
                        in_flight.append(group)
                        group = set()
                elif wait := re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s+0x([0-9a-f]+)", instruction):
                    del in_flight[:max(0, len(in_flight) - int(wait.group(1), 16))]
                elif walk and any(written_registers(instruction) & read for read in in_flight):
                    found.append(instruction)
    return sorted(set(found))


def loop_instructions(sass_text: str) -> int:
    """Instructions a warp issues per step of the kernel's loop over the reduced dimension: its last loop in the
    code that issues tensor-core products (a wait on an mbarrier compiles to a loop of its own)."""
    return len([body for body in loops(sass_text) if any(line.startswith("HGMMA") for line in body)][-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", choices=("gate_up", "down"), help="print this kernel's SASS instead")
    parser.add_argument("--rows", type=int, default=64, help="the FRAGMENT_TILES row with these rows")
    args = parser.parse_args()
    kernels = {"gate_up": serve_clef.nvfp4_gate_up_fragment_kernel, "down": serve_clef.nvfp4_down_fragment_kernel}

    def constexprs(tiles, name):  # as forward_fragments launches them for the real model (hidden 2048: slabs pair up)
        common = {"BLOCK_R": tiles.rows, "STAGES": tiles.num_stages, "SMALLEST_ROWS": tiles.smallest_rows or tiles.rows}
        return common | ({"SLAB_PAIRS": tiles.down_slab_pairs} if name == "down" else {"down_input_scale_ptr": None})

    if args.sass:
        tiles = next(tiles for _, tiles in serve_clef.FRAGMENT_TILES if tiles.rows == args.rows)
        print(sass(compile_for_hopper(kernels[args.sass], constexprs(tiles, args.sass))))
        return 0
    print(f"triton {triton.__version__}, sm_90a; registers decide programs per SM (65,536 registers, 228 KiB)")
    for most_pairs_per_expert, tiles in serve_clef.FRAGMENT_TILES:
        for name in ("gate_up", "down"):
            report = assembler_report(compile_for_hopper(kernels[name], constexprs(tiles, name)))
            slabs = "two slabs" if name == "gate_up" or tiles.down_slab_pairs else "one slab"
            print(f"up to {most_pairs_per_expert or 'any number of'} pairs per expert, R = {tiles.rows}, {name}, "
                  f"{slabs}: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
