#!/usr/bin/env bash
# Run a command on a pure cgroup v2 host: a throwaway QEMU guest that boots Debian's kernel and sees this
# machine's whole file system (9p), with every controller on the unified hierarchy.
#
#   bash scripts/cgroup_v2_guest.sh [--mem MB] [--cpus N] [--timeout S] [--kernel RELEASE] -- COMMAND [ARG...]
#
# --kernel boots the kernel of another Debian release (fetched from deb.debian.org), e.g. bullseye's
# 5.10: the kernels of Debian 11 and RHEL 9 (5.14) are v2 by default but older than 5.16, where the
# sandboxes' exec agent cannot be used. The default is this machine's apt's current kernel.
#
# The command runs as root in the current directory, with a fresh tmpfs on /tmp (but for the current
# directory, if it is there) and /run, no network but loopback, and this machine's files otherwise
# (writes reach them). Its output is printed when it
# ends; the script exits with its status (124 when the guest ran past --timeout).
#
# Why: most users' hosts are cgroup v2, while the development and CI machines are hybrid (every
# controller bound to v1, which cannot be undone while Docker runs there). The guest is the only place
# here where the sandboxes' v2 limits meet a real kernel. It runs under TCG (software emulation, about
# 20x slower than the host): /dev/kvm on these machines is a paravirtual flavour that a stock kernel
# cannot boot on. TANGRAM_V2_GUEST_ACCEL=kvm uses KVM where it is real.
#
# Needs root (9p passthrough), qemu-system-x86, busybox-static and Debian's apt (to fetch the kernel
# package once); as root with apt, the missing packages are installed. The kernel and the initramfs
# are kept in TANGRAM_V2_GUEST_DIR (/var/tmp/tangram-v2-guest).
set -euo pipefail

usage="[--mem MB] [--cpus N] [--timeout S] [--kernel RELEASE] -- COMMAND"
mem=4096 cpus=$(nproc) timeout_s=1800 release=
while [ $# -gt 0 ]; do
  case "$1" in
    --mem) mem=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --kernel) release=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "cgroup_v2_guest: unknown option $1 (usage: $usage)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "cgroup_v2_guest: no command (usage: $usage)" >&2; exit 2; }
case "$release" in
  ""|[a-z]*[a-z]) ;;
  *) echo "cgroup_v2_guest: --kernel takes a Debian release's name (bullseye, bookworm), not '$release'" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "cgroup_v2_guest: needs root (the guest writes this machine's files as root over 9p)" >&2; exit 2; }

missing=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || missing+=(qemu-system-x86)
# A static busybox: it runs in the initramfs, which has no libc.
[ "$(dpkg-query -W -f='${Status}' busybox-static 2>/dev/null)" = "install ok installed" ] || missing+=(busybox-static)
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || { echo "cgroup_v2_guest: install ${missing[*]}" >&2; exit 2; }
  echo "cgroup_v2_guest: installing ${missing[*]}" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

jobs=${TANGRAM_V2_GUEST_DIR:-/var/tmp/tangram-v2-guest}
dir=$jobs/kernel-${release:-apt}  # the kernel and its initramfs
mkdir -p "$dir"
# The kernel: Debian's current one for this release (or --kernel's), fetched and unpacked once, with
# the modules that mount this machine's root (9p over virtio; the Debian kernel builds them as
# modules), in the order they load.
load_order="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci 9pnet 9pnet_virtio netfs fscache 9p"
if [ ! -f "$dir/vmlinuz" ] || [ ! -d "$dir/modules" ]; then
  work=$(mktemp -d "$dir/build.XXXXXX")
  if [ -z "$release" ]; then
    package=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9].*\)$/\1/p' | head -1)
    [ -n "$package" ] || { echo "cgroup_v2_guest: apt knows no linux-image-amd64 (run apt-get update)" >&2; exit 2; }
    (cd "$work" && apt-get download -qq "$package" 2>/dev/null) || { echo "cgroup_v2_guest: cannot download $package" >&2; exit 2; }
  else
    mirror=http://deb.debian.org/debian
    # The release's newest generic kernel (not its cloud or rt flavours).
    file=$(curl -fsS "$mirror/dists/$release/main/binary-amd64/Packages.xz" | xz -dc \
      | awk '/^Package: /{p = $2 ~ /^linux-image-[0-9.]+-[0-9]+-amd64$/} p && /^Filename: /{print $2}' | sort -V | tail -1) || true
    [ -n "$file" ] || { echo "cgroup_v2_guest: no kernel found for Debian '$release' at $mirror" >&2; exit 2; }
    curl -fsS -o "$work/kernel.deb" "$mirror/$file" || { echo "cgroup_v2_guest: cannot download $mirror/$file" >&2; exit 2; }
  fi
  dpkg-deb -x "$work"/*.deb "$work/root"
  mkdir -p "$work/modules"
  for m in $load_order; do
    found=$(find "$work"/root/lib/modules/*/kernel -name "$m.ko" -o -name "$m.ko.xz" | head -1)
    case "$found" in
      *.xz) xz -dc "$found" > "$work/modules/$m.ko" ;;
      ?*) cp "$found" "$work/modules/" ;;
    esac  # absent: built into this kernel, or not needed by it
  done
  rm -rf "$dir/modules"
  mv "$work/modules" "$dir/modules"
  mv "$work"/root/boot/vmlinuz-* "$dir/vmlinuz"
  rm -rf "$work"
fi

# The guest's init (rebuilt into the initramfs whenever it changes): mount this machine's root, a fresh
# /tmp and /run, and cgroup2 alone on /sys/fs/cgroup, then run the job and power off.
init=$(cat <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /newroot
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $load_order; do [ -f /m/\$m.ko ] && insmod /m/\$m.ko; done
INIT
cat <<'INIT'
job=$(sed -n 's/.*tangram_job=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,access=client host /newroot \
  || { echo "cgroup_v2_guest: cannot mount the host's root"; echo o > /proc/sysrq-trigger; }
cd /newroot
mount -t proc proc proc
mount -t sysfs sys sys
mount -t devtmpfs dev dev
mkdir -p dev/pts dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts dev/pts
mount -t tmpfs shm dev/shm
mount -t tmpfs run run
# A fresh /tmp, but the folders of this machine's /tmp the job needs (its own folder, the working
# directory) stay where they were, bound from the host's /tmp.
keep=$(cat "./$job/keep" 2>/dev/null)
[ -n "$keep" ] && mkdir -p run/host-tmp && mount --bind tmp run/host-tmp
mount -t tmpfs tmp tmp && chmod 1777 tmp
printf '%s\n' "$keep" | while IFS= read -r path; do
  [ -n "$path" ] && mkdir -p ".$path" && mount --bind "run/host-tmp/${path#/tmp/}" ".$path"
done
mount -t cgroup2 cgroup2 sys/fs/cgroup
# switch_root, not chroot: the host's root must be the mount namespace's own root, or setns() into a
# sandbox's mount namespace (nsenter) lands in the initramfs.
exec switch_root /newroot /bin/sh -c "hostname cgroup-v2-guest; ip link set lo up 2>/dev/null; /bin/sh $job/run.sh > $job/out.log 2>&1; echo \$? > $job/rc; sync; echo o > /proc/sysrq-trigger; sleep 10"
INIT
)
if [ ! -f "$dir/initrd.gz" ] || [ "$(cat "$dir/init" 2>/dev/null)" != "$init" ]; then
  work=$(mktemp -d "$dir/build.XXXXXX")
  mkdir -p "$work/initrd/bin"
  cp /bin/busybox "$work/initrd/bin/busybox"
  cp -r "$dir/modules" "$work/initrd/m"
  printf '%s\n' "$init" > "$work/initrd/init"
  chmod +x "$work/initrd/init"
  (cd "$work/initrd" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1 > "$work/initrd.gz")
  mv "$work/initrd.gz" "$dir/initrd.gz"
  printf '%s' "$init" > "$dir/init"
  rm -rf "$work"
fi

job=$(mktemp -d "$jobs/job.XXXXXX")
trap 'rm -rf "$job"' EXIT
for path in "$job" "$PWD"; do
  case "$path" in /tmp/*) echo "$path" ;; esac
done > "$job/keep"
{
  echo "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TMPDIR=/tmp"
  printf 'cd %q && exec' "$PWD"
  printf ' %q' "$@"
  echo
} > "$job/run.sh"
accel=${TANGRAM_V2_GUEST_ACCEL:-tcg}
if [ "$accel" = tcg ]; then cpu_flags=(-accel tcg,thread=multi -cpu max); else cpu_flags=(-accel "$accel" -cpu host); fi
status=0
timeout "$timeout_s" qemu-system-x86_64 "${cpu_flags[@]}" -m "$mem" -smp "$cpus" -nographic -no-reboot \
  -nic none -kernel "$dir/vmlinuz" -initrd "$dir/initrd.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 tangram_job=$job" \
  -virtfs local,path=/,mount_tag=host,security_model=passthrough,multidevs=remap \
  > "$job/console.log" 2>&1 || status=$?
cat "$job/out.log" 2>/dev/null || true
if [ "$status" = 124 ]; then
  echo "cgroup_v2_guest: the guest ran past ${timeout_s}s" >&2
  exit 124
fi
if [ ! -f "$job/rc" ]; then
  echo "cgroup_v2_guest: the guest ended without running the command (qemu exit $status); its console:" >&2
  tail -30 "$job/console.log" >&2
  exit 2
fi
exit "$(cat "$job/rc")"
