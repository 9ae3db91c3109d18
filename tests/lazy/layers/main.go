// lazy-layers: what tests/lazy/run.sh needs to serve image layers lazily from a registry on
// 127.0.0.1, built from stargz-snapshotter's published Go module (Apache-2.0), pinned at v0.15.1:
// the last release whose layer store is looked up by the compressed layer digest, which is what
// Podman 4.3 (containers/image 5.23) asks for. Later releases look layers up by their table of
// contents' digest, which containers/image asks for only from 5.31 (Podman 5.1).
//
//	lazy-layers store -root DIR MOUNTPOINT
//	    Mounts an additional layer store for containers/storage at MOUNTPOINT (FUSE) and serves
//	    until SIGINT or SIGTERM: MOUNTPOINT/base64(image reference)/LAYER DIGEST/diff is the
//	    layer's tree, fetched from the registry a chunk at a time on first read. No prefetch,
//	    no background fetch: every byte the registry serves was asked for by a reader.
//	lazy-layers push -registry HOST:PORT -image NAME:TAG [-chunk BYTES] LAYER.tar...
//	    Converts each tar to an eStargz layer and pushes an image of those layers (oldest
//	    first) to the registry over plain HTTP.
package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/containerd/stargz-snapshotter/fs/config"
	memorymetadata "github.com/containerd/stargz-snapshotter/metadata/memory"
	"github.com/containerd/stargz-snapshotter/service/resolver"
	"github.com/containerd/stargz-snapshotter/store"
	"github.com/opencontainers/go-digest"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "store":
		err = serveStore(os.Args[2:])
	case "push":
		err = push(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "lazy-layers %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: lazy-layers store -root DIR MOUNTPOINT\n"+
		"       lazy-layers push -registry HOST:PORT -image NAME:TAG [-chunk BYTES] LAYER.tar...")
	os.Exit(2)
}

func serveStore(args []string) error {
	flags := flag.NewFlagSet("store", flag.ExitOnError)
	root := flags.String("root", "", "directory for the store's cache")
	flags.Parse(args)
	if *root == "" || flags.NArg() != 1 {
		usage()
	}
	mountpoint := flags.Arg(0)
	ctx := context.Background()
	cfg := config.Config{
		NoPrefetch:        true,
		NoBackgroundFetch: true,
		// This release of the store cannot verify chunks (it says so and turns it off itself).
		DisableVerification: true,
		NoPrometheus:        true,
	}
	// A registry on a loopback address is spoken to over plain HTTP.
	hosts := resolver.RegistryHostsFromConfig(resolver.Config{})
	layers, err := store.NewLayerManager(ctx, *root, hosts, memorymetadata.NewReader, cfg)
	if err != nil {
		return fmt.Errorf("preparing the layer manager in %s: %w", *root, err)
	}
	if err := os.MkdirAll(mountpoint, 0o755); err != nil {
		return err
	}
	if err := store.Mount(ctx, mountpoint, layers, false); err != nil {
		return fmt.Errorf("mounting %s: %w", mountpoint, err)
	}
	fmt.Println("serving layers at", mountpoint)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
	return syscall.Unmount(mountpoint, syscall.MNT_DETACH)
}

// A blob as it goes into the image: its bytes, digest and, for layers, what the manifest says
// of it.
type blob struct {
	data        []byte
	digest      digest.Digest
	mediaType   string
	annotations map[string]string
}

func push(args []string) error {
	flags := flag.NewFlagSet("push", flag.ExitOnError)
	registry := flags.String("registry", "", "registry address, HOST:PORT")
	image := flags.String("image", "", "repository and tag, NAME:TAG")
	chunk := flags.Int("chunk", 0, "eStargz chunk size in bytes (0: the library's default, 4 MiB)")
	flags.Parse(args)
	name, tag, ok := strings.Cut(*image, ":")
	if *registry == "" || !ok || flags.NArg() == 0 {
		usage()
	}
	var layers []blob
	var diffIDs []digest.Digest
	for _, path := range flags.Args() {
		layer, diffID, err := estargzLayer(path, *chunk)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		layers = append(layers, layer)
		diffIDs = append(diffIDs, diffID)
	}
	imageConfig, _ := json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"config":       map[string]any{"Cmd": []string{"/bin/sh"}},
		"rootfs":       map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
	configBlob := blob{data: imageConfig, digest: digest.FromBytes(imageConfig),
		mediaType: "application/vnd.oci.image.config.v1+json"}
	base := "http://" + *registry + "/v2/" + name
	for _, b := range append(layers, configBlob) {
		if err := uploadBlob(base, b); err != nil {
			return err
		}
	}
	descriptor := func(b blob) map[string]any {
		d := map[string]any{"mediaType": b.mediaType, "digest": b.digest, "size": len(b.data)}
		if b.annotations != nil {
			d["annotations"] = b.annotations
		}
		return d
	}
	var layerDescriptors []map[string]any
	for _, l := range layers {
		layerDescriptors = append(layerDescriptors, descriptor(l))
	}
	manifest, _ := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        descriptor(configBlob),
		"layers":        layerDescriptors,
	})
	req, _ := http.NewRequest(http.MethodPut, base+"/manifests/"+tag, bytes.NewReader(manifest))
	req.Header.Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
	if err := send(req, http.StatusCreated); err != nil {
		return fmt.Errorf("pushing the manifest: %w", err)
	}
	fmt.Printf("pushed %s/%s:%s, %d eStargz layer(s)\n", *registry, name, tag, len(layers))
	return nil
}

// estargzLayer converts a tar file to an eStargz blob and returns it with the digest of the
// uncompressed tar it decompresses to.
func estargzLayer(path string, chunk int) (blob, digest.Digest, error) {
	f, err := os.Open(path)
	if err != nil {
		return blob{}, "", err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return blob{}, "", err
	}
	var opts []estargz.Option
	if chunk > 0 {
		opts = append(opts, estargz.WithChunkSize(chunk))
	}
	built, err := estargz.Build(io.NewSectionReader(f, 0, info.Size()), opts...)
	if err != nil {
		return blob{}, "", err
	}
	defer built.Close()
	data, err := io.ReadAll(built)
	if err != nil {
		return blob{}, "", err
	}
	uncompressed, err := gunzippedSize(data)
	if err != nil {
		return blob{}, "", err
	}
	return blob{
		data:      data,
		digest:    digest.Digest(fmt.Sprintf("sha256:%x", sha256.Sum256(data))),
		mediaType: "application/vnd.oci.image.layer.v1.tar+gzip",
		annotations: map[string]string{
			estargz.TOCJSONDigestAnnotation:         built.TOCDigest().String(),
			estargz.StoreUncompressedSizeAnnotation: strconv.FormatInt(uncompressed, 10),
		},
	}, built.DiffID(), nil
}

// gunzippedSize is the size of the tar an eStargz blob decompresses to: the input's entries
// rearranged, plus the table of contents and the landmark files, so it is measured from the
// blob itself (a stream of gzip members) rather than taken from the input.
func gunzippedSize(data []byte) (int64, error) {
	r, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		return 0, err
	}
	return io.Copy(io.Discard, r)
}

// uploadBlob pushes one blob unless the registry has it (the distribution API's monolithic
// upload: POST for a session, PUT with the digest).
func uploadBlob(base string, b blob) error {
	head, err := http.Head(base + "/blobs/" + b.digest.String())
	if err == nil && head.StatusCode == http.StatusOK {
		return nil
	}
	start, err := http.Post(base+"/blobs/uploads/", "", nil)
	if err != nil {
		return err
	}
	start.Body.Close()
	if start.StatusCode != http.StatusAccepted {
		return fmt.Errorf("starting the upload of %s: %s", b.digest, start.Status)
	}
	location, err := url.Parse(start.Header.Get("Location"))
	if err != nil {
		return err
	}
	target, _ := url.Parse(base)
	target = target.ResolveReference(location)
	query := target.Query()
	query.Set("digest", b.digest.String())
	target.RawQuery = query.Encode()
	req, _ := http.NewRequest(http.MethodPut, target.String(), bytes.NewReader(b.data))
	req.Header.Set("Content-Type", "application/octet-stream")
	if err := send(req, http.StatusCreated); err != nil {
		return fmt.Errorf("uploading %s: %w", b.digest, err)
	}
	return nil
}

func send(req *http.Request, want int) error {
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != want {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("%s: %s", resp.Status, body)
	}
	return nil
}
