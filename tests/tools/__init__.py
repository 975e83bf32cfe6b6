"""Tests of cuattn; folders mirror the package's layers."""
