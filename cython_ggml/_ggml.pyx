# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Thin Cython bridge over libggml-base's quantization API.

The declarations below mirror ``ggml/include/ggml.h`` of the pinned llama.cpp commit
(``struct ggml_type_traits``, ``ggml_quantize_chunk`` ...). They are written out here so the
extension compiles without llama.cpp's headers; the symbols are resolved at import time
against the libggml-base that ``cython_ggml/__init__.py`` loads with ``RTLD_GLOBAL``.
``cython_ggml.check_abi()`` verifies the struct layout against the loaded library.
"""

from libc.stdint cimport int64_t, uint8_t
from libc.stddef cimport size_t

cdef extern from *:
    """
    #include <stdint.h>
    #include <stddef.h>
    #include <stdbool.h>
    typedef void (*vd_to_float_t)(const void * x, float * y, int64_t k);
    typedef void (*vd_from_float_t)(const float * x, void * y, int64_t k);
    struct ggml_type_traits {
        const char * type_name;
        int64_t      blck_size;
        int64_t      blck_size_interleave;
        size_t       type_size;
        bool         is_quantized;
        vd_to_float_t   to_float;
        vd_from_float_t from_float_ref;
    };
    /* enum ggml_type is an int-sized C enum */
    const struct ggml_type_traits * ggml_get_type_traits(int type);
    void    ggml_quantize_init(int type);
    bool    ggml_quantize_requires_imatrix(int type);
    size_t  ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start,
                                int64_t nrows, int64_t n_per_row, const float * imatrix);
    int64_t ggml_blck_size(int type);
    size_t  ggml_type_size(int type);
    size_t  ggml_row_size(int type, int64_t ne);
    const char * ggml_type_name(int type);
    bool    ggml_validate_row_data(int type, const void * data, size_t nbytes);
    """
    ctypedef void (*vd_to_float_t)(const void * x, float * y, int64_t k) nogil
    cdef struct ggml_type_traits:
        const char * type_name
        int64_t blck_size
        int64_t blck_size_interleave
        size_t type_size
        bint is_quantized
        vd_to_float_t to_float
    const ggml_type_traits * ggml_get_type_traits(int type) nogil
    void ggml_quantize_init(int type) nogil
    bint ggml_quantize_requires_imatrix(int type) nogil
    size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start,
                               int64_t nrows, int64_t n_per_row, const float * imatrix) nogil
    int64_t ggml_blck_size(int type) nogil
    size_t ggml_type_size(int type) nogil
    size_t ggml_row_size(int type, int64_t ne) nogil
    const char * ggml_type_name(int type) nogil
    bint ggml_validate_row_data(int type, const void * data, size_t nbytes) nogil


def type_name(int qtype):
    """ggml's own name for ``qtype`` (e.g. ``"iq2_xxs"``), read from libggml."""
    cdef const char * s = ggml_type_name(qtype)
    return s.decode() if s != NULL else None


def blck_size(int qtype):
    """Weights per block of ``qtype`` (``ggml_blck_size``)."""
    return ggml_blck_size(qtype)


def type_size(int qtype):
    """Bytes per block of ``qtype`` (``ggml_type_size``)."""
    return ggml_type_size(qtype)


def row_size(int qtype, int64_t n_per_row):
    """Bytes of one row of ``n_per_row`` weights in ``qtype`` (``ggml_row_size``)."""
    return ggml_row_size(qtype, n_per_row)


def requires_imatrix_ggml(int qtype):
    """libggml's own rule, ``ggml_quantize_requires_imatrix`` (looser than llama-quantize's)."""
    return bool(ggml_quantize_requires_imatrix(qtype))


def traits(int qtype):
    """``ggml_get_type_traits(qtype)`` as a dict: type_name, blck_size, type_size,
    is_quantized, has_to_float."""
    cdef const ggml_type_traits * t = ggml_get_type_traits(qtype)
    return {
        "type_name": t.type_name.decode() if t.type_name != NULL else None,
        "blck_size": t.blck_size,
        "type_size": t.type_size,
        "is_quantized": bool(t.is_quantized),
        "has_to_float": t.to_float != NULL,
    }


def quantize_init(int qtype):
    """Builds the lookup grids of IQ types once (thread-safe in libggml)."""
    with nogil:
        ggml_quantize_init(qtype)


def quantize_rows(int qtype, const float[:, ::1] x, uint8_t[:, ::1] out,
                  int64_t row_start, int64_t row_stop, imatrix):
    """Quantizes rows ``[row_start, row_stop)`` of ``x`` into the same rows of ``out``.

    Releases the GIL. Each row is quantized independently by ``ggml_quantize_chunk``, so
    the bytes do not depend on how rows are split over threads. Returns bytes written.
    """
    cdef int64_t n_per_row = x.shape[1]
    cdef int64_t nrows = row_stop - row_start
    cdef const float[::1] im
    cdef const float * im_ptr = NULL
    cdef size_t written = 0
    cdef bint ok = True
    if nrows <= 0:
        return 0
    if imatrix is not None:
        im = imatrix
        im_ptr = &im[0]
    with nogil:
        written = ggml_quantize_chunk(qtype, &x[row_start, 0], &out[row_start, 0], 0,
                                      nrows, n_per_row, im_ptr)
        ok = ggml_validate_row_data(qtype, &out[row_start, 0], written)
    if not ok:
        raise RuntimeError("libggml produced %s data that fails ggml_validate_row_data"
                           % type_name(qtype))
    return written


def dequantize_rows(int qtype, const uint8_t[:, ::1] data, float[:, ::1] out,
                    int64_t row_start, int64_t row_stop):
    """Dequantizes rows ``[row_start, row_stop)`` with the type's ``to_float``; no GIL."""
    cdef const ggml_type_traits * t = ggml_get_type_traits(qtype)
    cdef int64_t n_per_row = out.shape[1]
    cdef int64_t r
    if t.to_float == NULL:
        raise ValueError("libggml has no to_float for type %s" % type_name(qtype))
    if row_stop <= row_start:
        return
    with nogil:
        t.to_float(&data[row_start, 0], &out[row_start, 0], (row_stop - row_start) * n_per_row)
