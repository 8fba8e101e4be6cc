package cli

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/alecthomas/units"
)

// Flag values whose errors name the flag and say what a good value looks
// like: kingpin's own say only `time: invalid duration "abc"` or
// `enum value must be one of nvml,sim, got 'foo'`, which leaves a newcomer
// to guess which of twenty flags is wrong.

// value is a kingpin.Value that parses with parse and names its flag when
// parse fails.
type value[T any] struct {
	flag   string
	target *T
	parse  func(string) (T, error)
	format func(T) string
}

func (v *value[T]) Set(s string) error {
	x, err := v.parse(s)
	if err != nil {
		return fmt.Errorf("invalid --%s %q: %w", v.flag, s, err)
	}
	*v.target = x
	return nil
}

func (v *value[T]) String() string { return v.format(*v.target) }

func setValue[T any](f *kingpin.FlagClause, target *T, parse func(string) (T, error), format func(T) string) {
	f.SetValue(&value[T]{flag: f.Model().Name, target: target, parse: parse, format: format})
}

// DurationVar makes f a duration flag, such as 5s, 2m or 1h30m.
func DurationVar(f *kingpin.FlagClause, target *time.Duration) {
	setValue(f, target, func(s string) (time.Duration, error) {
		d, err := time.ParseDuration(s)
		if err != nil {
			return 0, errors.New("want a duration such as 5s, 2m or 1h30m")
		}
		return d, nil
	}, time.Duration.String)
}

// Duration makes f a duration flag and returns its value.
func Duration(f *kingpin.FlagClause) *time.Duration {
	target := new(time.Duration)
	DurationVar(f, target)
	return target
}

// ParseBytes reads a size: a number of bytes (268435456), or a number with
// a unit as Prometheus writes them (256MiB, 1GiB, 1.5GiB; KB, MB and GB
// count in 1024s too, as in units.ParseBase2Bytes). A space before the
// unit ("256 MiB") is allowed.
func ParseBytes(s string) (uint64, error) {
	bad := errors.New("want a size in bytes, such as 268435456, 256MiB or 1GiB")
	s = strings.TrimSpace(s)
	if n, err := strconv.ParseUint(s, 10, 64); err == nil {
		return n, nil
	}
	if i := strings.IndexFunc(s, func(r rune) bool { return r != '.' && (r < '0' || r > '9') }); i > 0 {
		s = s[:i] + strings.TrimLeft(s[i:], " ")
	}
	n, err := units.ParseBase2Bytes(s)
	if err != nil || n < 0 || strings.HasPrefix(s, "-") {
		return 0, bad
	}
	return uint64(n), nil
}

// BytesVar makes f a size flag (see ParseBytes). Its help says how sizes
// read: KB, MB and GB count in 1024s, as Prometheus reads them, which
// surprises whoever expects 4GB to be 4,000,000,000 bytes.
func BytesVar(f *kingpin.FlagClause, target *uint64) {
	if h := f.Model().Help; !strings.Contains(h, "1024") {
		f.Help(strings.TrimSpace(h + " Sizes count in 1024s, as in Prometheus: 4GB and 4GiB are both 4 GiB."))
	}
	setValue(f, target, ParseBytes, func(n uint64) string { return strconv.FormatUint(n, 10) })
}

// Bytes makes f a size flag (see ParseBytes) and returns its value.
func Bytes(f *kingpin.FlagClause) *uint64 {
	target := new(uint64)
	BytesVar(f, target)
	return target
}

// EnumVar makes f a flag that takes one of options.
func EnumVar[T ~string](f *kingpin.FlagClause, target *T, options ...T) {
	names := make([]string, len(options))
	for i, o := range options {
		names[i] = string(o)
	}
	f.HintOptions(names...)
	setValue(f, target, func(s string) (T, error) {
		if !slices.Contains(options, T(s)) {
			return "", fmt.Errorf("want one of %s", strings.Join(names, ", "))
		}
		return T(s), nil
	}, func(v T) string { return string(v) })
}

// Enum makes f a flag that takes one of options and returns its value.
func Enum(f *kingpin.FlagClause, options ...string) *string {
	target := new(string)
	EnumVar(f, target, options...)
	return target
}

// IntVar makes f an integer flag.
func IntVar(f *kingpin.FlagClause, target *int) {
	setValue(f, target, func(s string) (int, error) {
		n, err := strconv.Atoi(s)
		if err != nil {
			return 0, errors.New("want a whole number")
		}
		return n, nil
	}, strconv.Itoa)
}

// Int makes f an integer flag and returns its value.
func Int(f *kingpin.FlagClause) *int {
	target := new(int)
	IntVar(f, target)
	return target
}

// Uint64 makes f a flag of a count that cannot be negative, and returns
// its value.
func Uint64(f *kingpin.FlagClause) *uint64 {
	target := new(uint64)
	setValue(f, target, func(s string) (uint64, error) {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return 0, errors.New("want a whole number, 0 or more")
		}
		return n, nil
	}, func(n uint64) string { return strconv.FormatUint(n, 10) })
	return target
}

// Float64Var makes f a number flag.
func Float64Var(f *kingpin.FlagClause, target *float64) {
	setValue(f, target, func(s string) (float64, error) {
		x, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return 0, errors.New("want a number")
		}
		return x, nil
	}, func(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) })
}

// Float64 makes f a number flag and returns its value.
func Float64(f *kingpin.FlagClause) *float64 {
	target := new(float64)
	Float64Var(f, target)
	return target
}
