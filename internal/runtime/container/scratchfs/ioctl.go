package scratchfs

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The btrfs ioctls used here (linux/btrfs.h); x/sys/unix has none of them.
const (
	iocSubvolCreate = 0x5000940e // _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
	iocSnapDestroy  = 0x5000940f // _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
	iocInoLookup    = 0xd0009412 // _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)
	iocFSInfo       = 0x8400941f // _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args)
	iocQuotaCtl     = 0xc0109428 // _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)
	iocQgroupLimit  = 0x8030942b // _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)

	quotaCtlEnableSimple = 4      // BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA
	qgroupLimitMaxRfer   = 1 << 0 // BTRFS_QGROUP_LIMIT_MAX_RFER
	clearLimit           = ^uint64(0)
	firstFreeObjectID    = 256 // BTRFS_FIRST_FREE_OBJECTID: a subvolume's root directory
)

// volArgs is struct btrfs_ioctl_vol_args.
type volArgs struct {
	fd   int64
	name [4088]byte
}

// inoLookupArgs is struct btrfs_ioctl_ino_lookup_args; with treeid 0 the
// kernel fills in the ID of the subvolume the descriptor is in.
type inoLookupArgs struct {
	treeid   uint64
	objectid uint64
	name     [4080]byte
}

// fsInfoArgs is struct btrfs_ioctl_fs_info_args.
type fsInfoArgs struct {
	maxID      uint64
	numDevices uint64
	fsid       [16]byte
	_          [1024 - 32]byte
}

// quotaCtlArgs is struct btrfs_ioctl_quota_ctl_args.
type quotaCtlArgs struct {
	cmd, status uint64
}

// qgroupLimitArgs is struct btrfs_ioctl_qgroup_limit_args.
type qgroupLimitArgs struct {
	qgroupid                                  uint64
	flags, maxRfer, maxExcl, rsvRfer, rsvExcl uint64
}

// Sizes the ioctl numbers encode; a mismatch is a bug caught at init.
func init() {
	for _, c := range []struct {
		req  uint
		size uintptr
	}{
		{iocSubvolCreate, unsafe.Sizeof(volArgs{})},
		{iocInoLookup, unsafe.Sizeof(inoLookupArgs{})},
		{iocFSInfo, unsafe.Sizeof(fsInfoArgs{})},
		{iocQuotaCtl, unsafe.Sizeof(quotaCtlArgs{})},
		{iocQgroupLimit, unsafe.Sizeof(qgroupLimitArgs{})},
	} {
		if got := uintptr(c.req>>16) & (1<<14 - 1); got != c.size {
			panic(fmt.Sprintf("scratchfs: ioctl %#x encodes size %d, struct is %d", c.req, got, c.size))
		}
	}
}

func ioctl(fd int, req uint, arg unsafe.Pointer) error {
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(arg))
	if e != 0 {
		return e
	}
	return nil
}

// loopDev is an attached loop device, open.
type loopDev struct {
	fd   int
	path string
}

// attachLoop attaches a free loop device to the file open as backing,
// set to detach itself once nothing holds it (LO_FLAGS_AUTOCLEAR: the
// mount, once the returned descriptor is closed) and to bypass the host's
// page cache (direct I/O: the file system above has its own).
func attachLoop(backing int) (loopDev, error) {
	ctl, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return loopDev{}, fmt.Errorf("scratchfs: %w", err)
	}
	defer unix.Close(ctl)
	for range 16 {
		n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return loopDev{}, fmt.Errorf("scratchfs: free loop device: %w", err)
		}
		path := fmt.Sprintf("/dev/loop%d", n)
		fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if errors.Is(err, os.ErrNotExist) {
			// No devtmpfs node (yet): make one (block major 7).
			if err = unix.Mknod(path, unix.S_IFBLK|0o600, int(unix.Mkdev(7, uint32(n)))); err == nil || errors.Is(err, os.ErrExist) {
				fd, err = unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
			}
		}
		if err != nil {
			return loopDev{}, fmt.Errorf("scratchfs: %w", err)
		}
		cfg := unix.LoopConfig{Fd: uint32(backing), Size: 4096}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
		err = unix.IoctlLoopConfigure(fd, &cfg)
		if errors.Is(err, unix.EBUSY) { // another process took it first
			unix.Close(fd)
			continue
		}
		if err != nil {
			unix.Close(fd)
			return loopDev{}, fmt.Errorf("scratchfs: configure %s: %w", path, err)
		}
		return loopDev{fd: fd, path: path}, nil
	}
	return loopDev{}, errors.New("scratchfs: no loop device stayed free")
}
