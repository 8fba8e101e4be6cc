package proc

import (
	"encoding/binary"
	"reflect"
	"testing"
)

// dirent encodes a linux_dirent64 record as the kernel does: NUL-terminated
// name, record padded to 8 bytes.
func dirent(name string) []byte {
	reclen := (19 + len(name) + 1 + 7) &^ 7
	b := make([]byte, reclen)
	binary.NativeEndian.PutUint64(b[0:], 1)
	binary.NativeEndian.PutUint16(b[16:], uint16(reclen))
	b[18] = 10 // DT_LNK
	copy(b[19:], name)
	return b
}

func TestEachDirent(t *testing.T) {
	var buf []byte
	names := []string{".", "..", "0", "1", "123456", "self", "a-very-long-name-indeed"}
	for _, n := range names {
		buf = append(buf, dirent(n)...)
	}
	var got []string
	eachDirent(buf, func(name []byte) { got = append(got, string(name)) })
	if !reflect.DeepEqual(got, names) {
		t.Errorf("names = %q, want %q", got, names)
	}

	// A record cut short, or one claiming more than the buffer, ends it.
	got = nil
	eachDirent(append(dirent("7"), dirent("8")[:20]...), func(name []byte) { got = append(got, string(name)) })
	if !reflect.DeepEqual(got, []string{"7"}) {
		t.Errorf("names = %q, want [7]", got)
	}
}

func TestAtoi(t *testing.T) {
	tests := []struct {
		in string
		n  int
		ok bool
	}{
		{"0", 0, true}, {"1", 1, true}, {"4194304", 4194304, true}, {"999999999", 999999999, true},
		{"", 0, false}, {"self", 0, false}, {"12a", 0, false}, {"-1", 0, false}, {"1234567890", 0, false},
	}
	for _, tt := range tests {
		if n, ok := atoi([]byte(tt.in)); n != tt.n || ok != tt.ok {
			t.Errorf("atoi(%q) = %d, %v; want %d, %v", tt.in, n, ok, tt.n, tt.ok)
		}
	}
}

func FuzzEachDirent(f *testing.F) {
	f.Add(append(dirent("12"), dirent("self")...))
	f.Add(dirent("0")[:10])
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, buf []byte) {
		total := 0
		eachDirent(buf, func(name []byte) {
			total += len(name)
			if len(name) > len(buf) {
				t.Fatalf("name longer than buffer")
			}
		})
		if total > len(buf) {
			t.Fatalf("names total %d bytes of a %d-byte buffer", total, len(buf))
		}
	})
}
