#!/usr/bin/env python3
"""Writes an OCI image archive (what `ctr images import` and `docker load` take) without a
registry: one layer per directory given, bottom first, uncompressed.

usage: oci-image.py OUT.tar NAME:TAG LAYERDIR [LAYERDIR...]
"""
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile


def blob(out, data):
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}", len(data)


def layer(out, directory):
    """The directory as a tar layer, streamed through a temporary file (layers may be GiBs)."""
    with tempfile.TemporaryFile() as tmp:
        with tarfile.open(fileobj=tmp, mode="w", format=tarfile.PAX_FORMAT) as t:
            for name in sorted(os.listdir(directory)):
                t.add(os.path.join(directory, name), arcname=name)
        size = tmp.tell()
        tmp.seek(0)
        h = hashlib.sha256()
        for chunk in iter(lambda: tmp.read(1 << 20), b""):
            h.update(chunk)
        tmp.seek(0)
        info = tarfile.TarInfo(f"blobs/sha256/{h.hexdigest()}")
        info.size = size
        out.addfile(info, tmp)
        return f"sha256:{h.hexdigest()}", size


def main():
    out_path, ref, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
    with tarfile.open(out_path, "w") as out:
        layers, diff_ids = [], []
        for d in dirs:
            digest, size = layer(out, d)
            layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar",
                           "digest": digest, "size": size})
            diff_ids.append(digest)
        config = json.dumps({
            "architecture": "amd64", "os": "linux",
            "config": {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }).encode()
        cdigest, csize = blob(out, config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": cdigest, "size": csize},
            "layers": layers,
        }).encode()
        mdigest, msize = blob(out, manifest)
        name = ref if "/" in ref.split(":")[0] else f"docker.io/library/{ref}"
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": mdigest, "size": msize,
            "annotations": {"org.opencontainers.image.ref.name": ref.split(":")[-1],
                            "io.containerd.image.name": name}}]}).encode()
        for fname, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)):
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))


main()
