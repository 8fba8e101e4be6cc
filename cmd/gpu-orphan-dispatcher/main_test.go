package main_test

import (
	"os"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }
