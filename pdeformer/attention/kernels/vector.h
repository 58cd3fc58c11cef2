/* Vectors of VW doubles: 4 where AVX is there (the kernels are compiled for the host
   CPU), else 2 (SSE2, NEON). Shared by laplace_kernels.c and the FMA probe of
   benchmarks/velocity.py (pdeformer.attention.compiled.VECTOR_C is this file). */
#ifndef PDEFORMER_VECTOR_H
#define PDEFORMER_VECTOR_H
#if defined(__AVX__)
#define VW 4
#else
#define VW 2
#endif
typedef double vec __attribute__((vector_size(8 * VW)));
#endif
