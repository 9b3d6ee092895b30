package main

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// budgetShare is the part of the memory available at start that the default
// --max-state-bytes allows optimizer state to take.
const budgetShare = 0.75

// defaultStateBudget is budgetShare of the memory available to this process
// at start: the smaller of /proc/meminfo's MemAvailable and the room left
// under the cgroup v2 memory.max of its cgroup. 0 (no bound) when neither
// can be read.
func defaultStateBudget() int64 {
	avail := memAvailable()
	if room := cgroupRoom(); room > 0 && (avail <= 0 || room < avail) {
		avail = room
	}
	if avail <= 0 {
		return 0
	}
	return int64(float64(avail) * budgetShare)
}

// memAvailable is MemAvailable of /proc/meminfo in bytes (0: unknown).
func memAvailable() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemAvailable:" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0
			}
			return kb << 10
		}
	}
	return 0
}

// cgroupRoom is memory.max - memory.current of this process's cgroup v2 (0:
// no limit or unknown).
func cgroupRoom() int64 {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return 0
	}
	var dir string
	for _, line := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			dir = "/sys/fs/cgroup" + strings.TrimSpace(p)
		}
	}
	if dir == "" {
		return 0
	}
	read := func(name string) int64 {
		b, err := os.ReadFile(dir + "/" + name)
		if err != nil {
			return 0
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64) // "max" -> error -> 0
		if err != nil {
			return 0
		}
		return n
	}
	max := read("memory.max")
	if max <= 0 {
		return 0
	}
	if room := max - read("memory.current"); room > 0 {
		return room
	}
	return 1 // at or over the limit already: no room
}

// parseBytes reads a byte count: a plain integer or one with a binary unit
// (K, M, G, T, optionally followed by "iB" or "B": 1 KiB = 1024 bytes).
func parseBytes(s string) (int64, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "I") // 64GiB -> 64G, 100B -> 100
	mult := int64(1)
	if i := len(t) - 1; i >= 0 {
		if k := strings.IndexByte("KMGT", t[i]); k >= 0 {
			mult, t = int64(1)<<(10*(k+1)), strings.TrimSpace(t[:i])
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 0 || n > (1<<62)/mult {
		return 0, fmt.Errorf("%q: want a byte count such as 68719476736, 64GiB or 512M (0: no bound)", s)
	}
	return n * mult, nil
}
