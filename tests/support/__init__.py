"""Helpers the tests share: references, case tables, harnesses; no tests here."""
