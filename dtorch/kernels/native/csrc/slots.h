// How an ISA object hands its kernels to table.cpp: by name, type-erased, with the row's signature as text (both
// sides stringify the same row, so a mismatch means objects of two different op lists were linked together).
#pragma once

namespace dtn {

using AnyFn = void (*)();

// Called by each ISA object's static initializer (isa_fill.h), once per kernel or value of its group; returns true.
// fn: the kernel (cast to AnyFn), or value: the address of the per-ISA constant
bool add_slot(const char* isa, const char* group, const char* name, const char* signature, AnyFn fn,
              const void* value);

}  // namespace dtn
