# Sourced on the GPU machine: `. tools/gpu/unpack.sh DIR` unpacks DIR/pack.tar.xz
# (tools/gpu/pack-devbin.sh), puts DIR on PATH and seeds the kernel cache from DIR/kcache.
d=$(cd "$1" && pwd)
[ -f "$d/pack.tar.xz" ] && (cd "$d" && tar xJf pack.tar.xz && rm pack.tar.xz)
export DS4_KERNEL_CACHE=${DS4_KERNEL_CACHE:-/tmp/ds4-kernels} PATH=$d:$PATH
[ -d "$d/kcache" ] && mkdir -p "$DS4_KERNEL_CACHE" && cp -n "$d"/kcache/* "$DS4_KERNEL_CACHE/"
true
