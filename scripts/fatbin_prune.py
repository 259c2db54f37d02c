"""List / prune CUDA fatbin entries inside an ELF shared object.

Adapted from the prototype GPU recipe's fatbin_prune.py (shared/device/
fatbin_prune.py of the project's steering repo, run end to end on the lent
H200 in 2026-11); used by scripts/bundle.sh through scripts/gpu_bundle.py.

usage: fatbin_prune.py list FILE
       fatbin_prune.py prune FILE OUT --keep-arch 90 [--keep-ptx]
(--keep-ptx keeps PTX even in containers that hold a kept-arch cubin)
Pruning zeroes the payload of every cubin whose arch is not kept (and, unless
--keep-ptx, PTX entries too), leaving all headers and offsets intact, so the
file keeps its size but compresses far better.  The CUDA runtime only uses
the image matching the device (sm_90 / sm_90a on H200).
"""
import struct, sys
from collections import defaultdict


def sections(data):
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    shs = []
    for i in range(e_shnum):
        off = e_shoff + i * e_shentsize
        name, typ, flags, addr, offset, size = struct.unpack_from("<IIQQQQ", data, off)
        shs.append((name, typ, offset, size))
    stroff = shs[e_shstrndx][2]
    out = {}
    for name, typ, offset, size in shs:
        end = data.index(b"\0", stroff + name)
        out[data[stroff + name:end].decode()] = (offset, size)
    return out


def entries(data):
    off, size = sections(data)[".nv_fatbin"]
    pos, end = off, off + size
    cid = 0
    while pos < end:
        magic, ver, hsz, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != 0xBA55ED50:
            # alignment padding between containers
            pos += 8
            continue
        epos = pos + hsz
        cend = epos + fsize
        while epos < cend:
            kind, _u1, ehsz, esize = struct.unpack_from("<HHIQ", data, epos)
            arch, = struct.unpack_from("<I", data, epos + 28)
            flags, = struct.unpack_from("<Q", data, epos + 40)
            yield dict(kind=kind, arch=arch, flags=flags, hdr=epos, payload=epos + ehsz, size=esize, cid=cid)
            epos += ehsz + esize
        pos = cend
        cid += 1


def main():
    cmd, path = sys.argv[1], sys.argv[2]
    data = bytearray(open(path, "rb").read())
    stats = defaultdict(lambda: [0, 0])
    ents = list(entries(data))
    for e in ents:
        k = ("ptx" if e["kind"] == 1 else "elf" if e["kind"] == 2 else f"k{e['kind']}", e["arch"])
        stats[k][0] += 1
        stats[k][1] += e["size"]
    for k in sorted(stats):
        print(k, stats[k][0], f"{stats[k][1]/1e6:.2f} MB")
    if cmd == "prune":
        out = sys.argv[3]
        keep = {int(a) for a in sys.argv[sys.argv.index("--keep-arch") + 1].split(",")}
        keep_ptx = "--keep-ptx" in sys.argv
        z = 0
        # per container (one per compiled .cu): if it has a cubin for a kept
        # arch, nothing else in it is needed; otherwise keep PTX <= max kept
        # arch so the driver can JIT it (unless --no-ptx-fallback)
        has_keep = {e["cid"] for e in ents if e["kind"] == 2 and e["arch"] in keep}
        for e in ents:
            if e["kind"] == 2:
                drop = e["arch"] not in keep
            elif e["kind"] == 1:
                drop = (e["cid"] in has_keep and not keep_ptx) or e["arch"] > max(keep)
            else:
                drop = False
            if drop:
                data[e["payload"]:e["payload"] + e["size"]] = bytes(e["size"])
                z += e["size"]
        open(out, "wb").write(data)
        print(f"zeroed {z/1e6:.2f} MB")


if __name__ == "__main__":
    main()
